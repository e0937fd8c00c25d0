"""Data other tools wrote, read in place (convit_scale/manifest.py): WebDataset shards in timm's layout, written
with webdataset's own ShardWriter as timm's ImageNet shards are published; and the other way round, `prep wds`'s
shards read by timm's own WebDataset reader."""

import json
import shutil
import tarfile

import numpy as np
import pytest
import torch
from support import epoch_batches, losses, records, run_many, tiny_recipe, train_here

from convit_scale.cli import main
from convit_scale.data.formats import detect_format
from convit_scale.manifest import DataError, Manifest


@pytest.fixture(scope="module")
def timm_shards(fm_tree, tmp_path_factory):
    """fm_tree as timm's ImageNet shards: imagenet1k-{split}-NNNN.tar of KEY.jpg, KEY.cls and KEY.json (shuffled
    before sharding, as timm's are), `train` and `validation` splits, and _info.json listing files and lengths."""
    import random

    import webdataset as wds

    root = tmp_path_factory.mktemp("timm_wds")
    classes = sorted(p.name for p in (fm_tree / "train").iterdir() if p.is_dir())
    info = {"name": "imagenet-1k", "splits": {}}
    for split, folder in (("train", "train"), ("validation", "val")):
        items = [(p, label) for label, c in enumerate(classes) for p in sorted((fm_tree / folder / c).iterdir())]
        random.Random(0).shuffle(items)
        with wds.ShardWriter(str(root / f"imagenet1k-{split}-%04d.tar"), maxcount=300, verbose=0) as sink:
            for i, (path, label) in enumerate(items):
                sink.write({"__key__": f"{split}_{i:08d}", "jpg": path.read_bytes(), "cls": label,
                            "json": {"label": label, "filename": path.name}})
        names = sorted(p.name for p in root.glob(f"imagenet1k-{split}-*.tar"))
        lengths = [min(300, len(items) - 300 * k) for k in range(len(names))]
        info["splits"][split] = {"name": split, "num_samples": len(items), "filenames": names,
                                 "shard_lengths": lengths}
    (root / "_info.json").write_text(json.dumps(info))
    return root


def test_timm_layout_is_described_by_its_info_file(timm_shards):
    assert detect_format(str(timm_shards)) == "wds"
    m = Manifest.read(timm_shards)
    assert (m.format, m.classes, m.num_classes) == ("wds", [], 0)  # class names: not in such a folder
    assert m.split("train").num_samples == 1000 and len(m.split("train").shards()) == 4
    assert m.split("val") is m.splits["validation"] and m.split("val").num_samples == 200
    with pytest.raises(DataError, match="manifest has no 'test' split; .*it has: train, validation"):
        m.split("test")
    (timm_shards / "_info.json").rename(timm_shards / "_info.bak")
    try:
        with pytest.raises(DataError, match="WebDataset shards without manifest.json or timm's _info.json; describe "
                                            "them once with `convit-scale prep index"):
            Manifest.read(timm_shards)
        with pytest.raises(DataError, match="describe them once with `convit-scale prep index"):
            detect_format(str(timm_shards))
    finally:
        (timm_shards / "_info.bak").rename(timm_shards / "_info.json")


STOP, TOTAL = 2, 4
"""The resumed runs: 2 steps on 1 rank, then on 2 ranks up to step 4 (mid-epoch: 1000 images make 31 steps of 32)."""


def _resume_on_two_ranks(tmp, fmt: str, path, **data) -> dict:
    """A run of STOP steps on 1 rank (in this process), then, in one 2-rank launch, its resume up to TOTAL and the
    same recipe uninterrupted on 2 ranks: {"resumed", "full": output folders, "statuses", "log": the launch's
    output}."""
    sections = dict(checkpoint={"every_steps": STOP}, log={"every_steps": 1, "progress": False,
                                                          "debug_samples": True}, data=data)
    resumed = tiny_recipe(tmp / "r.yaml", fmt, path, tmp / "run", schedule={"max_steps": STOP}, **sections)
    full = tiny_recipe(tmp / "full.yaml", fmt, path, tmp / "full", schedule={"max_steps": TOTAL}, **sections)
    first = train_here(resumed)
    statuses = run_many([{"recipe": resumed, "overrides": [f"schedule.max_steps={TOTAL}"]}, {"recipe": full}],
                        tmp / "launch")
    return {"resumed": tmp / "run", "full": tmp / "full", "statuses": [first, *statuses],
            "log": (tmp / "launch" / "output.txt").read_text()}


def _assert_continues(runs: dict):
    """As tests/test_train_elastic.py's: the run stopped at STOP on 1 rank and resumed on 2 is the uninterrupted
    2-rank run, step for step: the same losses (within 1e-5, relative) and every step's global batch the same sample
    ids in the same order."""
    assert runs["statuses"] == [0, 0, 0], runs["statuses"]
    checkpoint = runs["resumed"] / "checkpoints" / f"step_{STOP:09d}"
    assert any(f"resumed from {checkpoint} at step {STOP}" in line and f"resumed step {STOP} from 1 rank(s) on 2"
               in line for line in runs["log"].splitlines()), runs["log"][-3000:]
    got, want = losses(runs["resumed"]), losses(runs["full"])
    assert len(got) == len(want) == TOTAL
    for step, (a, b) in enumerate(zip(got, want), 1):
        assert abs(a - b) <= 1e-5 * abs(b), f"step {step}: {a} resumed, {b} uninterrupted"
    ids = [(r["step"], r["ids"]) for r in records(runs["resumed"], "samples")]
    assert ids == [(r["step"], r["ids"]) for r in records(runs["full"], "samples")]
    assert [step for step, _ in ids] == list(range(1, TOTAL + 1))
    assert all(len(batch) == 32 for _, batch in ids)
    every = [i for _, batch in ids for i in batch]
    assert len(set(every)) == len(every)  # the epoch continues: no sample twice


@pytest.fixture(scope="module")
def timm_runs(timm_shards, tmp_path_factory):
    return _resume_on_two_ranks(tmp_path_factory.mktemp("timm_runs"), "wds", timm_shards)


def test_timm_shards_stopped_on_one_rank_resume_on_two_as_the_uninterrupted_run(timm_runs):
    _assert_continues(timm_runs)
    ids = [i for rec in records(timm_runs["resumed"], "samples") for i in rec["ids"]]
    assert all(str(i).split("/")[0].startswith("imagenet1k-train-") for i in ids), ids[:3]


def test_train_resume_evaluate_and_analyse_timm_shards_without_prep(timm_shards, timm_runs, tmp_path, capsys):
    """The loader, preflight, eval and analyze on another tool's shards, as they are: every step's samples are the
    shards' own (labels from .cls), a run of 2 steps on 1 rank continues on 2 ranks with none of its samples twice,
    and the whole validation split is evaluated once."""
    out = timm_runs["resumed"]
    assert timm_runs["statuses"][:2] == [0, 0], timm_runs["statuses"]
    assert [rec["step"] for rec in records(out, "samples")] == [1, 2, 3, 4]
    ids = [i for rec in records(out, "samples") for i in rec["ids"]]
    assert len(ids) == 4 * 32 == len(set(ids))
    assert all(str(i).split("/")[0].startswith("imagenet1k-train-") for i in ids), ids[:3]
    assert records(out, "eval")[-1]["samples"] == 200
    res = tmp_path / "eval.json"
    assert main(["eval", "--checkpoint", str(out), "--data", str(timm_shards), "--workers", "0", "--device", "cpu",
                 "--results-file", str(res)]) == 0
    r = json.loads(res.read_text())
    assert r["format"] == "wds" and r["images"] == 200 and {c["class"] for c in r["per_class"]} == {None}
    assert main(["analyze", "--checkpoint", str(out), "--data", str(timm_shards), "--out", str(tmp_path / "a"),
                 "--images", "40", "--device", "cpu"]) == 0
    assert json.loads((tmp_path / "a" / "analysis.json").read_text())["images"] == 40


def test_prep_wds_shards_are_read_by_timms_own_reader(fm_wds, tmp_path):
    """`prep wds` writes timm's _info.json beside its manifest: timm's WebDataset reader (what `train.py --dataset
    wds/...` uses) reads the shards, every sample once with its label, the val split under timm's default name
    (`validation`: train.py's --val-split, create_dataset's split) while the manifest keeps `val`."""
    from PIL import Image
    from timm.data import create_dataset

    manifest = Manifest.read(fm_wds)
    for ours, kwargs in (("train", {"split": "train"}), ("val", {})):  # {}: timm's default split
        dataset = create_dataset("wds/fm", root=str(fm_wds), is_training=False, **kwargs)
        assert len(dataset) == manifest.split(ours).num_samples
        labels = {}
        for img, target in dataset:
            assert isinstance(img, Image.Image)
            labels[target] = labels.get(target, 0) + 1
        assert {str(k): v for k, v in labels.items()} == manifest.split(ours).per_class
    info = json.loads((fm_wds / "_info.json").read_text())
    assert sorted(info["splits"]) == ["train", "validation"] and sorted(manifest.splits) == ["train", "val"]
    assert info["splits"]["train"]["filenames"] == [f for f, _ in manifest.split("train").shards()]
    alone = tmp_path / "info_alone"  # described by the _info.json alone: `validation` read back as our val
    alone.mkdir()
    (alone / "_info.json").write_text(json.dumps(info))
    assert Manifest.read(alone).split("val").shards() == manifest.split("val").shards()


def _write_ffcv_imagenet(root, split: str, tree, fields=("image", "label"), extra: bool = False):
    """One split of ``tree`` as ffcv-imagenet's write_imagenet.py writes it: torchvision's ImageFolder into ffcv's
    DatasetWriter, an RGBImageField (its example's proportion mode, compress probability 0.5, quality 90) and an
    IntField; ``extra``: a third field the loader must leave alone."""
    from torchvision.datasets import ImageFolder

    from convit_scale.ffcv_threads import importing_ffcv

    with importing_ffcv():
        from ffcv.fields import FloatField, IntField, RGBImageField
        from ffcv.writer import DatasetWriter

    class WithExtra:
        def __init__(self, ds):
            self.ds = ds

        def __len__(self):
            return len(self.ds)

        def __getitem__(self, i):
            image, label = self.ds[i]
            return (float(i), label, image) if extra else (image, label)

    image = RGBImageField(write_mode="proportion", max_resolution=32, compress_probability=0.5, jpeg_quality=90)
    spec = {fields[0]: image, fields[1]: IntField()}
    if extra:  # fields written in another order, with one the loader does not use
        spec = {"weight": FloatField(), fields[1]: IntField(), fields[0]: image}
    path = root / f"{split}_32_0.50_90.ffcv"
    # Which images the field compresses is drawn from numpy's global generator in the writer's workers: seeded, and
    # one worker (a second would take chunks from a shared queue in whatever order), the same images are JPEGs on
    # every run. Drawn afresh, some runs truncated both images of a canonical group of a test below.
    state = np.random.get_state()
    np.random.seed(0)
    try:
        DatasetWriter(str(path), spec, num_workers=1).from_indexed_dataset(WithExtra(ImageFolder(str(tree / split))))
    finally:
        np.random.set_state(state)
    return path


@pytest.fixture(scope="module")
def ffcv_imagenet(fm_tree, tmp_path_factory):
    root = tmp_path_factory.mktemp("ffcv_imagenet")
    for split in ("train", "val"):
        _write_ffcv_imagenet(root, split, fm_tree)
    return root


def test_ffcv_files_are_described_by_their_label_column(ffcv_imagenet, fm_ffcv):
    """A folder of ffcv-imagenet's files, or one file named, is FFCV data: samples per class and the labels' count
    from the label column, no class names (such files have none); a lone file serves any split."""
    assert detect_format(str(ffcv_imagenet)) == "ffcv"
    m = Manifest.read(ffcv_imagenet)
    assert (m.format, m.classes, m.num_classes) == ("ffcv", [], 10)
    assert m.split("train").per_class == {str(c): 100 for c in range(10)} and m.split("val").num_samples == 200
    assert m.split("train").per_class == Manifest.read(fm_ffcv).split("train").per_class
    lone = Manifest.read(ffcv_imagenet / "val_32_0.50_90.ffcv")
    assert detect_format(str(ffcv_imagenet / "val_32_0.50_90.ffcv")) == "ffcv"
    assert lone.split("train") is lone.split("val") and lone.split("val").num_samples == 200
    with pytest.raises(DataError, match=r"FFCV fields \['image', 'label'\], no 'img' image field .*data.ffcv_fields"):
        Manifest.read(ffcv_imagenet, ("img", "label"))


@pytest.fixture(scope="module")
def ffcv_runs(ffcv_imagenet, tmp_path_factory):
    return _resume_on_two_ranks(tmp_path_factory.mktemp("ffcv_runs"), "ffcv", ffcv_imagenet,
                                val_path=str(ffcv_imagenet / "val_32_0.50_90.ffcv"))


def test_ffcv_imagenet_files_stopped_on_one_rank_resume_on_two_as_the_uninterrupted_run(ffcv_runs):
    _assert_continues(ffcv_runs)


def test_train_resume_on_two_ranks_evaluate_analyse_and_verify_ffcv_imagenet_files(ffcv_imagenet, ffcv_runs,
                                                                                   tmp_path):
    """ffcv-imagenet's files as they are: a run of 2 steps on 1 rank resumed on 2 ranks continues the same samples,
    a Table 2 subset takes the first images of each class, eval and analyze read the val file, and `prep verify`
    checks them."""
    from convit_scale.config import DataConfig
    from convit_scale.data import LoaderSpec, build_loader

    out = ffcv_runs["resumed"]
    assert ffcv_runs["statuses"][:2] == [0, 0], ffcv_runs["statuses"]
    steps = [rec["step"] for rec in records(out, "samples")]
    assert steps == [1, 2, 3, 4], steps
    ids = [i for rec in records(out, "samples") for i in rec["ids"]]
    assert len(ids) == 4 * 32 and len(set(ids)) == len(ids)  # the epoch continues: no sample twice
    assert records(out, "eval")[-1]["samples"] == 200
    res = tmp_path / "eval.json"
    assert main(["eval", "--checkpoint", str(out), "--data", str(ffcv_imagenet / "val_32_0.50_90.ffcv"),
                 "--workers", "0", "--device", "cpu", "--results-file", str(res)]) == 0
    assert json.loads(res.read_text())["images"] == 200
    assert main(["analyze", "--checkpoint", str(out), "--data", str(ffcv_imagenet / "val_32_0.50_90.ffcv"),
                 "--out", str(tmp_path / "a"), "--images", "40", "--device", "cpu"]) == 0
    assert json.loads((tmp_path / "a" / "analysis.json").read_text())["images"] == 40
    half = DataConfig(format="ffcv", train_path=str(ffcv_imagenet), val_path=str(ffcv_imagenet), num_workers=1,
                      subset_fraction=0.5, repeated_aug=1)
    loader = build_loader(half, LoaderSpec("train", 16, 10, seed=0))
    assert loader.num_samples == 500 and sorted(loader._indices.tolist()) == [
        c * 100 + i for c in range(10) for i in range(50)]  # ImageFolder order: by class, then file
    from data_prep import verify

    assert verify(ffcv_imagenet) == []


def test_ffcv_field_names_are_set_by_the_recipe(fm_tree, tmp_path):
    """Fields named otherwise, written in another order, with a field the loader does not read: data.ffcv_fields
    names them; without it the refusal names the file's fields and the key."""
    from convit_scale.config import DataConfig
    from convit_scale.data import LoaderSpec, build_loader

    path = _write_ffcv_imagenet(tmp_path, "val", fm_tree, fields=("img", "target"), extra=True)
    with pytest.raises(DataError, match=r"fields \['weight', 'target', 'img'\].*data.ffcv_fields"):
        build_loader(DataConfig(format="ffcv", val_path=str(path)), LoaderSpec("val", 16, 50))
    d = DataConfig(format="ffcv", train_path=str(path), val_path=str(path), num_workers=1,
                   ffcv_fields=("img", "target"))
    batches = list(build_loader(d, LoaderSpec("val", 16, 50)).epoch(0))
    assert sum(len(b.labels) for b in batches) == 200
    assert batches[0].images.shape[1:] == (3, 16, 16) and batches[0].labels.tolist()[:3] == [0, 0, 0]
    from data_prep import verify  # `prep verify --ffcv-fields`: its images decoded from the field named

    assert verify(path, ffcv_fields=("img", "target")) == []
    problems = verify(path, ffcv_fields=("weight", "target"))
    assert len(problems) == 1 and "FFCV field 'weight' is a FloatField, not an RGBImageField; set data.ffcv_fields" \
        in problems[0], problems


def test_data_num_classes_keeps_the_first_labels_at_load_or_refuses_shards_converted_without(ffcv_imagenet, fm_tree,
                                                                                              fm_wds):
    """The appendix's 100-class runs from whole data: FFCV files (here ffcv-imagenet's) and ImageFolder trees keep
    the first N labels at load time, Table 2's subset within them; WebDataset shards hold their classes from the
    conversion, so shards of all 10 are refused for N = 4, naming the command that makes them."""
    from convit_scale.config import DataConfig
    from convit_scale.data import LoaderSpec, build_loader

    d = DataConfig(format="ffcv", train_path=str(ffcv_imagenet), val_path=str(ffcv_imagenet), num_workers=1,
                   subset_fraction=0.5, repeated_aug=1, num_classes=4)
    assert build_loader(d, LoaderSpec("train", 16, 10)).num_samples == 4 * 50
    labels = [int(x) for b in build_loader(d, LoaderSpec("val", 16, 40)).epoch(0) for x in b.labels]
    assert sorted(labels) == sorted(list(range(4)) * 20)
    tree = DataConfig(format="imagefolder", train_path=str(fm_tree), val_path=str(fm_tree), num_workers=0,
                      num_classes=3)
    assert build_loader(tree, LoaderSpec("val", 16, 20)).num_samples == 3 * 20
    shards = DataConfig(format="wds", train_path=str(fm_wds), val_path=str(fm_wds), num_workers=0, num_classes=4)
    with pytest.raises(DataError, match=r"shards hold 10 classes, data.num_classes = 4; convert with `convit-scale "
                                        r"prep wds --num-classes 4`"):
        build_loader(shards, LoaderSpec("val", 16, 20))


def _truncated(jpeg: bytes) -> bytes:
    """A JPEG cut a few bytes into its scan (a download or copy that stopped there): no crop box of it decodes."""
    return jpeg[:jpeg.index(b"\xff\xda") + 24]


def _rewrite_tar(path, change) -> None:
    """Rewrite a tar shard with ``change(member_name, payload) -> payload`` applied to every member."""
    import io

    with tarfile.open(path) as tar:
        members = [(m, tar.extractfile(m).read()) for m in tar]
    with tarfile.open(path, "w", format=tarfile.USTAR_FORMAT) as tar:
        for m, data in members:
            data = change(m.name, data)
            m.size = len(data)
            tar.addfile(m, io.BytesIO(data))


def _train_loader(fmt: str, path, **keys):
    """The train loader of a 1-rank run of tiny_recipe's batch (32, 16 canonical groups of 2) on ``path``."""
    from convit_scale.config import DataConfig
    from convit_scale.data import LoaderSpec, build_loader
    from convit_scale.models import MODELS

    d = DataConfig(format=fmt, train_path=str(path), val_path=str(path), global_batch_size=32, repeated_aug=1,
                   **keys)
    return build_loader(d, LoaderSpec("train", MODELS["convit_nano"].img_size, 32, global_batch_size=32,
                                      canonical_groups=d.groups))


def _first_steps(loader, steps: int = 3, start: int = 0) -> list[tuple]:
    """(images, labels, bad samples) of ``steps`` batches of epoch 0 from batch ``start`` (``epoch_batches``'), the
    epoch then closed."""
    batches = loader.epoch(0, start)
    try:
        return [(b.images.clone(), b.labels.clone(), b.bad) for _, b in zip(range(steps), batches)]
    finally:
        batches.close()


def _assert_replaced_and_logged(broken, clean, path, tmp_path, fmt: str, **data) -> list[dict]:
    """Training on ``path`` (a copy of another tool's data with truncated JPEGs) as on the project's own
    (tests/test_data_faults.py): the first 3 steps' batches are whole, each bad sample replaced where it stood and
    listed, every other sample the clean data's, the same after a resume at the first batch with a bad one;
    metrics.jsonl lists each bad sample of the 3 steps trained, as the loader does; past data.max_bad_samples the
    loader stops naming the file. Returns the bad samples listed."""
    import dataclasses

    from convit_scale.data import DataError

    got, want = _first_steps(broken), _first_steps(clean)
    expected = [{"step": step, "epoch": 0, **r, "rank": 0} for step, (_, _, bad) in enumerate(got, 1) for r in bad]
    assert expected, "the first 3 steps meet no truncated JPEG: truncate more"
    for (x, y, bad), (x0, y0, _) in zip(got, want, strict=True):
        assert x.shape == x0.shape and len(y) == len(y0) == 32
        changed = [k for k in range(32) if not torch.equal(x[k], x0[k]) or y[k] != y0[k]]
        assert len(changed) == len(bad)  # the bad samples' places only
    k = next(n for n, (_, _, bad) in enumerate(got) if bad)
    again = _first_steps(broken, len(got) - k, k)
    assert all(torch.equal(a[0], b[0]) and torch.equal(a[1], b[1]) and a[2] == b[2] for a, b in zip(got[k:], again))
    r = tiny_recipe(tmp_path / "r.yaml", fmt, path, tmp_path / "out", schedule={"max_steps": 3},
                    data={"val_path": "", **data})
    assert train_here(r) == 0
    logged = [{k: v for k, v in rec.items() if k != "kind"} for rec in records(tmp_path / "out", "bad_sample")]
    assert logged == expected
    # each truncated JPEG reached the crop-region decoder, which refused it (then the whole decode failed): counted
    # in the training log, the loader workers' decodes included; the good ones decoded as boxes
    last = records(tmp_path / "out", "train")[-1]
    assert last["step"] == 3 and last["crop_decode_refused"] >= len(expected)
    assert last["crop_boxes_decoded"] + last["crop_decode_refused"] >= 3 * 32
    broken.d = dataclasses.replace(broken.d, max_bad_samples=0)
    with pytest.raises(DataError, match=rf": {len(got[k][2])} unreadable samples in epoch 0 on rank 0, more than "
                                        r"data.max_bad_samples = 0 \(last: key ") as e:
        epoch_batches(broken)
    assert str(e.value).startswith(f"{path}/") and "\n" not in str(e.value)  # the shard or file named
    return [r for _, _, bad in got for r in bad]


def test_a_truncated_jpeg_in_timm_shards_is_replaced_listed_and_limited_as_in_prepared_shards(timm_shards, tmp_path):
    path = tmp_path / "timm"
    shutil.copytree(timm_shards, path)
    cut = set()
    for shard in sorted(path.glob("imagenet1k-train-*.tar")):
        with tarfile.open(shard) as tar:
            victims = [m.name for m in tar if m.name.endswith(".jpg")][::25]  # 12 of each 300
        _rewrite_tar(shard, lambda name, data, v=set(victims): _truncated(data) if name in v else data)
        cut.update({(str(shard), v.rsplit(".", 1)[0]) for v in victims})
    bad = _assert_replaced_and_logged(_train_loader("wds", path, num_workers=0),  # the run: a forked worker
                                      _train_loader("wds", timm_shards, num_workers=0), path, tmp_path, "wds",
                                      num_workers=1)
    assert all((r["shard"], r["key"]) in cut and r["reason"].startswith("undecodable image") for r in bad), bad


def _ffcv_images(beton):
    """(the image field's metadata, the allocation table's rows by address) of an ffcv-imagenet file."""
    from convit_scale.ffcv_threads import importing_ffcv

    with importing_ffcv():
        from ffcv.reader import Reader

    reader = Reader(str(beton))
    rows = {int(p): row for row, p in enumerate(reader.alloc_table["ptr"])}
    return reader.metadata[f"f{reader.field_names.index('image')}"], rows, reader


def _cut_ffcv_jpegs(beton) -> list[int]:
    """Every 5th of the JPEGs of an ffcv-imagenet file (ffcv's writer stores about half its images as JPEGs: compress
    probability 0.5) ended a few bytes into its scan, an end-of-image marker written there (the file's layout is
    kept); returns their sample indices."""
    meta, rows, reader = _ffcv_images(beton)
    jpegs = [k for k in range(len(meta)) if int(meta["mode"][k]) == 0]
    assert 300 < len(jpegs) < 700, len(jpegs)
    cut = jpegs[::5]
    with open(beton, "r+b") as f:
        for k in cut:
            ptr = int(meta["data_ptr"][k])
            f.seek(ptr)
            stored = f.read(int(reader.alloc_table["size"][rows[ptr]]))
            f.seek(ptr + len(_truncated(stored)))
            f.write(b"\xff\xd9")
    return cut


def test_a_truncated_jpeg_in_an_ffcv_imagenet_file_is_replaced_listed_and_limited_as_in_prepared_files(
        ffcv_imagenet, tmp_path):
    """Every 5th JPEG of the file ends a few bytes into its scan (``_cut_ffcv_jpegs``)."""
    path = tmp_path / "ffcv"
    shutil.copytree(ffcv_imagenet, path)
    beton = path / "train_32_0.50_90.ffcv"
    cut = _cut_ffcv_jpegs(beton)
    bad = _assert_replaced_and_logged(_train_loader("ffcv", path, num_workers=1),
                                      _train_loader("ffcv", ffcv_imagenet, num_workers=1), path, tmp_path, "ffcv",
                                      num_workers=1)
    assert all(r["file"] == str(beton) and r["key"] in cut and r["reason"] == "undecodable JPEG (turbojpeg "
               "refused it)" for r in bad), bad


def test_prep_verify_decodes_a_sample_of_ffcv_imagenet_files_and_names_each_image_that_fails(ffcv_imagenet,
                                                                                             tmp_path, capsys,
                                                                                             monkeypatch):
    """FFCV files without a manifest: `prep verify` decodes each split's images as the FFCV loader does (it read the
    label column alone: 'no image decoded'). The clean files pass; each JPEG cut short, and raw pixels stored short
    (one sample's allocation cut by 3 bytes), is named by file and sample index; DECODE_SAMPLE bounds the images
    decoded, evenly spaced."""
    import sys

    verify_module = sys.modules["data_prep.verify"]  # the module (the package's `verify` is its function)
    line = "no manifest.json: every FFCV file's label column read (samples, labels); "
    assert main(["prep", "verify", str(ffcv_imagenet)]) == 0
    assert capsys.readouterr().out.strip() == f"verified {ffcv_imagenet}: {line}1200 of 1200 images decoded"
    path = tmp_path / "ffcv"
    shutil.copytree(ffcv_imagenet, path)
    beton = path / "train_32_0.50_90.ffcv"
    cut = _cut_ffcv_jpegs(beton)
    meta, rows, reader = _ffcv_images(beton)
    short = next(k for k in range(len(meta)) if int(meta["mode"][k]) == 1)
    size = int(reader.alloc_table["size"][rows[int(meta["data_ptr"][short])]])
    with open(beton, "r+b") as f:  # the row's size field: (sample_id, ptr, size), 8 bytes each
        f.seek(int(reader.header["alloc_table_ptr"]) + rows[int(meta["data_ptr"][short])] * 24 + 16)
        f.write(np.uint64(size - 3).tobytes())
    assert main(["prep", "verify", str(path)]) == 1
    captured = capsys.readouterr()
    errors = [e for e in captured.err.splitlines() if e.startswith("error: ")]
    assert all(e.startswith(f"error: {beton}: sample ") for e in errors), errors
    named = {int(e.split(": sample ")[1].split()[0]): e for e in errors}
    assert sorted(named) == sorted(cut + [short]) and len(named) == len(errors)
    h, w = int(meta["height"][short]), int(meta["width"][short])
    assert named[short].endswith(f"does not decode (raw pixels: {size - 3} bytes stored, {h} x {w} x 3 = {size} "
                                 f"expected)")
    # ended where they were cut, PIL decodes them (with a warning): the loader's decoder refuses them
    assert all(named[k].endswith("does not decode (turbojpeg, the FFCV loader's decoder, refused it; PIL: decodes "
                                 "it)") for k in cut), errors
    assert captured.out.strip() == f"{path}: {len(errors)} problem(s) ({line}1200 of 1200 images decoded)"
    monkeypatch.setattr(verify_module, "DECODE_SAMPLE", 100)  # every 10th train image, every 2nd val image
    checked = []
    problems = verify_module.verify(path, checked=checked)
    sampled = sorted(k for k in cut + [short] if k % 10 == 0)
    assert sampled and [int(p.split(": sample ")[1].split()[0]) for p in problems] == sampled
    assert checked == [f"{line}200 of 1200 images decoded (a sample)"]
