"""Converters (manifest, bad input, resume, verify) and loaders (per-rank equality, coverage, resume)."""

import collections
import io
import json
import os
import subprocess
import tarfile

import numpy as np
import pytest
import torch
from PIL import Image
from support import REPO, run_cli, torchrun_cmd

from convit_scale.config import DataConfig
from convit_scale.data import DataError, LoaderSpec, build_loader
from convit_scale.data.geometry import EpochGeometry
from data_prep import PrepError, PrepOptions, prepare, shard_plan, verify


def _jpeg(color=(200, 30, 30), size=(40, 30), mode="RGB", fmt="JPEG") -> bytes:
    buf = io.BytesIO()
    img = Image.new("RGB", size, color)
    if mode != "RGB":
        img = img.convert(mode)
    img.save(buf, format=fmt)
    return buf.getvalue()


@pytest.fixture()
def messy_tree(tmp_path):
    """An ImageNet-like tree with the real-world oddities of ImageNet, and broken files."""
    root = tmp_path / "src"
    for split, n in (("train", 6), ("val", 2)):
        for c in ("n01", "n02", "n03"):
            (root / split / c).mkdir(parents=True)
            for i in range(n):
                (root / split / c / f"{c}_{i}.JPEG").write_bytes(_jpeg((i * 40, 10, 200)))
    t = root / "train"
    (t / "n01" / "cmyk.JPEG").write_bytes(_jpeg(mode="CMYK"))
    (t / "n01" / "grey.JPEG").write_bytes(_jpeg(mode="L"))
    (t / "n02" / "png_named.JPEG").write_bytes(_jpeg(fmt="PNG"))
    (t / "n02" / "empty.JPEG").write_bytes(b"")
    (t / "n03" / "truncated.JPEG").write_bytes(_jpeg(size=(200, 200))[:300])
    (t / "n03" / "text.JPEG").write_bytes(b"this is not an image")
    (t / "n04").mkdir()  # an empty class folder
    return root


def test_bad_inputs_are_converted_or_skipped_and_listed(messy_tree, tmp_path):
    out = tmp_path / "wds"
    m = prepare(messy_tree, out, PrepOptions(fmt="wds", shard_size=5, workers=2)).to_dict()
    assert m == json.loads((out / "manifest.json").read_text())  # what prep returns is what it wrote
    train = m["splits"]["train"]
    assert m["classes"] == ["n01", "n02", "n03", "n04"]
    # 3 x 6 good + CMYK + grey + PNG (converted to RGB JPEG)
    assert train["num_samples"] == 21
    assert train["per_class"] == {"0": 8, "1": 7, "2": 6}
    reasons = {os.path.basename(s["path"]): s["reason"] for s in train["skipped"]}
    assert reasons["empty.JPEG"] == "empty file"
    assert reasons["truncated.JPEG"].startswith("undecodable") and reasons["text.JPEG"].startswith("undecodable")
    assert reasons["n04"] == "empty class folder"
    assert verify(out) == []
    sizes = [rec["samples"] for rec in train["files"].values()]
    assert sizes == shard_plan(21, 5) and max(sizes) - min(sizes) <= 1
    assert all(name.startswith("train-f1-s5-") for name in train["files"])
    # every stored image is an RGB JPEG
    name = sorted(train["files"])[0]
    with tarfile.open(out / name) as tar:
        jpgs = [tar.extractfile(mm).read() for mm in tar if mm.name.endswith(".jpg")]
    assert all(Image.open(io.BytesIO(b)).mode == "RGB" and Image.open(io.BytesIO(b)).format == "JPEG" for b in jpgs)
    assert (out / "classes.txt").read_text().splitlines()[1] == "1\tn02"


def test_strict_missing_and_empty_sources(messy_tree, tmp_path):
    with pytest.raises(PrepError, match="under --strict"):
        prepare(messy_tree, tmp_path / "o", PrepOptions(fmt="wds", strict=True, workers=1))
    with pytest.raises(PrepError, match="source folder not found"):
        prepare(tmp_path / "nope", tmp_path / "o2", PrepOptions())
    (tmp_path / "empty" / "train").mkdir(parents=True)
    with pytest.raises(PrepError, match="no class folders"):
        prepare(tmp_path / "empty", tmp_path / "o3", PrepOptions())
    res = run_cli("prep", "wds", "--src", str(tmp_path / "nope"), "--out", str(tmp_path / "o4"))
    assert res.returncode == 2 and res.stderr.strip() == f"error: source folder not found: {tmp_path / 'nope'}"


def _flat_val_tree(root, val_names):
    """Two train classes (n01, n02) of one image each and a flat val/ folder with these file names."""
    for c in ("n01", "n02"):
        (root / "train" / c).mkdir(parents=True)
        (root / "train" / c / "a.JPEG").write_bytes(_jpeg())
    (root / "val").mkdir()
    for name in val_names:
        (root / "val" / name).write_bytes(_jpeg())
    return root


def test_flat_val_with_kaggle_labels(tmp_path):
    root = _flat_val_tree(tmp_path / "src", [f"ILSVRC2012_val_{i:08d}.JPEG" for i in range(3)])
    (root / "LOC_val_solution.csv").write_text("ImageId,PredictionString\n" + "".join(
        f"ILSVRC2012_val_{i:08d},{w} 1 2 3 4\n" for i, w in enumerate(["n02", "n01", "n02"])))
    m = prepare(root, tmp_path / "o", PrepOptions(fmt="wds", workers=1)).to_dict()
    assert m["splits"]["val"]["per_class"] == {"0": 1, "1": 2}


def test_flat_val_with_devkit_ground_truth(tmp_path):
    root = _flat_val_tree(tmp_path / "src", [f"ILSVRC2012_val_{i + 1:08d}.JPEG" for i in range(3)])
    # ILSVRC ids are 1-based positions in the synset list, which is not the sorted class order
    (tmp_path / "synsets.txt").write_text("n02 thing two\nn01 thing one\n")
    (tmp_path / "gt.txt").write_text("1\n2\n1\n")
    m = prepare(root, tmp_path / "o", PrepOptions(fmt="wds", workers=1, val_labels=str(tmp_path / "gt.txt"),
                                                  val_synsets=str(tmp_path / "synsets.txt")))
    assert m.split("val").per_class == {"0": 1, "1": 2}  # n01 -> 0 once, n02 -> 1 twice
    with pytest.raises(PrepError, match="needs --val-synsets"):
        prepare(root, tmp_path / "o2", PrepOptions(fmt="wds", workers=1, val_labels=str(tmp_path / "gt.txt")))


def test_interrupted_conversion_resumes_without_redoing(fm_tree, tmp_path):
    out = tmp_path / "w"
    prepare(fm_tree, out, PrepOptions(fmt="wds", shard_size=100, workers=2, splits=("train",)))
    shards = sorted(out.glob("train-*.tar"))
    mtimes = {p.name: p.stat().st_mtime_ns for p in shards}
    shards[3].unlink()  # as if interrupted before this shard was written
    (out / "manifest.json").unlink()
    (out / "junk.tar.tmp").write_bytes(b"half")  # a half-written temp file never counts
    prepare(fm_tree, out, PrepOptions(fmt="wds", shard_size=100, workers=2, splits=("train",)))
    for p in sorted(out.glob("train-*.tar")):
        if p.name != shards[3].name:
            assert p.stat().st_mtime_ns == mtimes[p.name], p.name  # not redone
    assert shards[3].is_file() and verify(out) == []


def test_verify_catches_a_corrupted_shard_and_loader_refuses_a_truncated_one(fm_tree, tmp_path):
    out = tmp_path / "w"
    prepare(fm_tree, out, PrepOptions(fmt="wds", shard_size=250, workers=2))
    shard = sorted(out.glob("train-*.tar"))[1]
    data = shard.read_bytes()
    shard.write_bytes(data[: len(data) // 2])  # truncated
    problems = verify(out)
    assert any(shard.name in p and "checksum" in p for p in problems)
    res = run_cli("prep", "verify", str(out))
    assert res.returncode == 1 and shard.name in res.stderr
    d = DataConfig(format="wds", train_path=str(out), val_path=str(out), num_workers=0, repeated_aug=1)
    loader = build_loader(d, LoaderSpec("train", 32, 50))
    with pytest.raises(DataError, match="truncated or corrupt shard"):
        for _ in loader.epoch(0):
            pass


def _global_steps(n: int, world: int, batch: int, groups: int, repeats: int = 1, epoch: int = 0) -> list[list[int]]:
    """Each step's global batch (sample indices, in canonical order: rank 0's groups, then rank 1's, ...)."""
    ranks = []
    for r in range(world):
        spec = LoaderSpec("train", 32, batch // world, world, r, seed=0, global_batch_size=batch,
                          canonical_groups=groups)
        ranks.append(EpochGeometry.of(n, spec, "test").sample_indices(epoch, repeats)[0].reshape(-1, batch // world))
    return np.concatenate(ranks, axis=1).tolist()


def test_epoch_plan_is_the_same_at_any_world_size_with_repeats_spread_over_groups():
    for n, batch, groups in ((1000, 32, 4), (1001, 48, 4), (70, 8, 2)):
        steps = _global_steps(n, 1, batch, groups)
        assert len(steps) == n // batch  # the last partial global batch dropped, no padding
        for world in (2, groups):
            assert _global_steps(n, world, batch, groups) == steps
        flat = [i for step in steps for i in step]
        assert len(set(flat)) == len(flat) and set(flat) <= set(range(n))  # every view of the epoch at most once
    assert _global_steps(100, 2, 8, 2, epoch=1) != _global_steps(100, 2, 8, 2, epoch=0)
    rep = _global_steps(99, 2, 12, 4, repeats=3)  # 33 images x 3, each image's copies in different groups
    assert set(collections.Counter(i for step in rep for i in step).values()) <= {1, 2, 3}
    for step in rep:
        groups_of = collections.defaultdict(set)
        for slot, i in enumerate(step):
            groups_of[i].add(slot // 3)  # group g holds slots [3g, 3g + 3)
        assert all(len(g) == step.count(i) for i, g in groups_of.items())


def test_transforms_shapes_and_ranges(fm_tree):
    lo, hi = (0 - 0.485) / 0.229 - 1e-4, (1 - 0.406) / 0.225 + 1e-4  # ImageNet-normalised [0, 1] pixels
    for reprob in (0.0, 1.0):
        d = DataConfig(format="imagefolder", train_path=str(fm_tree), val_path=str(fm_tree), num_workers=0,
                       reprob=reprob)
        for split in ("train", "val"):
            x, y = next(iter(build_loader(d, LoaderSpec(split, 32, 8)).epoch(0)))
            assert x.shape == (8, 3, 32, 32) and x.dtype == torch.float32 and y.dtype == torch.long
            assert torch.isfinite(x).all() and ((0 <= y) & (y < 10)).all()
            in_range = bool(((lo <= x) & (x <= hi)).all())
            # random erasing (pixel mode) writes N(0, 1) noise: only then values leave the range
            assert in_range == (split == "val" or reprob == 0.0)


def test_wds_url_locations_stream_through_pipe(fm_wds):
    d = DataConfig(format="wds", train_path=f"pipe:cat {fm_wds}/{{name}}", val_path=str(fm_wds), num_workers=0)
    loader = build_loader(d, LoaderSpec("train", 32, 16))
    x, y = next(iter(loader.epoch(0)))
    assert x.shape == (16, 3, 32, 32)


@pytest.fixture(scope="module")
def two_rank_loaders(fm_wds, fm_ffcv, tmp_path_factory):
    """Both formats' loaders on 2 ranks of 2 workers each, in one launch: {format: (data folder, results folder)}."""
    tmp = tmp_path_factory.mktemp("two_rank_loaders")
    cases = {"wds": (fm_wds, tmp / "wds"), "ffcv": (fm_ffcv, tmp / "ffcv")}
    for _, out in cases.values():
        out.mkdir()
    cmd = torchrun_cmd(2, str(REPO / "tests" / "dist_loader_check.py"), "2", "1",
                       *(f"{fmt}={path}={out}" for fmt, (path, out) in cases.items()))
    res = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert res.returncode == 0, res.stderr[-3000:]
    return cases


@pytest.mark.slow
@pytest.mark.parametrize("fmt", ["wds", "ffcv"])
def test_two_ranks_two_workers_equal_batches_and_coverage(fmt, two_rank_loaders):
    path, out = two_rank_loaders[fmt]
    manifest = json.loads((path / "manifest.json").read_text())
    ranks = [json.loads((out / f"rank{r}.json").read_text()) for r in range(2)]
    for split in ("train", "val"):
        want = collections.Counter({int(k): v for k, v in manifest["splits"][split]["per_class"].items()})
        for epoch in (0, 1):
            key = f"{split}{epoch}"
            assert len(ranks[0][key]["batches"]) == len(ranks[1][key]["batches"]) == ranks[0][key]["len"]
            assert ranks[0][key]["shapes"] == [[3, 32, 32]]
            got = collections.Counter()
            for r in ranks:
                labels = [label for batch in r[key]["batches"] for label in batch][: r[key]["num_real"]]
                got.update(labels)
            if split == "val":
                assert got == want  # exact: every image once, padding not counted
            else:  # 1000 images, batches of 16 on 2 ranks: 496 per rank, 8 dropped in total
                assert sum(got.values()) == 992 and all(want[c] - got[c] >= 0 for c in want)
        if split == "train":  # a new order each epoch
            assert ranks[0]["train0"]["batches"] != ranks[0]["train1"]["batches"]
    for r in ranks:  # resume position: the rest of the epoch is the same batches, the same pixels
        assert r["resumed"] == r["train0"]["batches"][5:]
        assert r["resumed_images"] == r["train0"]["images"][5:]
    assert ranks[0]["train0"]["images"][0] != ranks[1]["train0"]["images"][0]  # each rank its own share


def test_bench_steady_state_counts_whole_waves_of_batches():
    """Two workers making a batch each per second, side by side: 2 batches/s, not the 9 batches in 4 s that
    counting from the first arrival gives; a last batch made alone (odd count) is left out."""
    from convit_scale.bench.data import steady_state

    arrivals = [1, 1, 2, 2, 3, 3, 4, 4, 5, 5]
    for tail in ([], [6]):
        images, seconds = steady_state(arrivals + tail, [64] * (10 + len(tail)), workers=2)
        assert (images, seconds) == (8 * 64, 4)
    assert steady_state([1, 2, 3, 4], [64] * 4, workers=1) == (3 * 64, 3)
