"""`prep ffcv|wds --src` from what people download (data_prep/sources.py): Parquet files as ImageNet-1k is published
in Parquet (an image column of {bytes, path} structs, an integer label column, row groups of 100), and WebDataset
shards (another tool's, in timm's layout, or a `prep wds` output), read where they lie: no tree is unpacked."""

from __future__ import annotations

import json
import random
import tarfile

import pytest

from convit_scale.imagetree import PrepError
from data_prep import PrepOptions, prepare, shard_plan, verify


def _items(tree, split: str) -> list[tuple]:
    classes = sorted(p.name for p in (tree / "train").iterdir() if p.is_dir())
    return [(p, label) for label, c in enumerate(classes) for p in sorted((tree / split / c).iterdir())]


def _write_parquet(root, tree, shuffled: bool = True):
    """data/train-0000N-of-00002.parquet and data/validation-00000-of-00001.parquet of the tree's images."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    (root / "data").mkdir(parents=True)
    for split, name, parts in (("train", "train", 2), ("val", "validation", 1)):
        items = _items(tree, split)
        if shuffled:
            random.Random(1).shuffle(items)
        per = -(-len(items) // parts)
        for k in range(parts):
            chunk = items[k * per:(k + 1) * per]
            table = pa.table({"image": [{"bytes": p.read_bytes(), "path": p.name} for p, _ in chunk],
                              "label": pa.array([label for _, label in chunk], pa.int64())})
            pq.write_table(table, root / "data" / f"{name}-{k:05d}-of-{parts:05d}.parquet", row_group_size=100)
    return root


@pytest.fixture(scope="module")
def parquet_src(fm_tree, tmp_path_factory):
    return _write_parquet(tmp_path_factory.mktemp("parquet"), fm_tree)


def _members(out) -> list[bytes]:
    found = []
    for shard in sorted(out.glob("*.tar")):
        with tarfile.open(shard) as tar:
            found += [tar.extractfile(m).read() for m in tar if m.name.endswith(".jpg")]
    return found


def test_parquet_to_wds_keeps_every_image_and_label_in_the_sources_order(parquet_src, fm_tree, fm_wds, tmp_path):
    out = tmp_path / "wds"
    m = prepare(parquet_src, out, PrepOptions(fmt="wds", shard_size=96, workers=2))
    ours = json.loads((fm_wds / "manifest.json").read_text())
    for split in ("train", "val"):
        assert m.split(split).per_class == ours["splits"][split]["per_class"]
    assert m.classes == [] and m.num_classes == 10 and not (out / "classes.txt").exists()  # none made up
    assert verify(out) == []
    source = {p.read_bytes() for p, _ in _items(fm_tree, "train") + _items(fm_tree, "val")}
    written = _members(out)
    converted = [b for b in written if b not in source]  # greyscale JPEGs become RGB, as from a tree
    assert len(written) == 1200 and len(converted) in (0, 1200)
    labels = [label for _, label in _items(fm_tree, "train")]
    random.Random(1).shuffle(labels)  # the source's order: shards keep it (no second shuffle over row groups)
    first = sorted(out.glob("train-*.tar"))[0]
    with tarfile.open(first) as tar:
        got = [int(tar.extractfile(m).read()) for m in tar if m.name.endswith(".cls")]
    assert len(got) == shard_plan(1000, 96)[0] and got == labels[:len(got)]


def test_parquet_to_ffcv_with_a_subset_and_fewer_classes(parquet_src, fm_ffcv, tmp_path):
    """Table 2's subset takes the first images of each class in the source's order; --num-classes the first
    labels; the .beton reads back as the loaders read it."""
    from convit_scale.config import DataConfig
    from convit_scale.data import LoaderSpec, build_loader

    out = tmp_path / "ffcv"
    m = prepare(parquet_src, out, PrepOptions(fmt="ffcv", workers=2, subset_fraction=0.5, num_classes=4))
    assert m.split("train").per_class == {str(c): 50 for c in range(4)}
    assert m.split("val").per_class == {str(c): 20 for c in range(4)}
    assert verify(out) == []
    d = DataConfig(format="ffcv", train_path=str(out), val_path=str(out), num_workers=1)
    batches = list(build_loader(d, LoaderSpec("val", 16, 40)).epoch(0))
    assert sorted(int(x) for b in batches for x in b.labels) == sorted(list(range(4)) * 20)


def test_a_parquet_source_sorted_by_class_is_refused_for_wds(fm_tree, tmp_path):
    src = _write_parquet(tmp_path / "sorted", fm_tree, shuffled=False)
    with pytest.raises(PrepError, match=r"sorted by class \(100 rows of one label in a row\).*prep ffcv"):
        prepare(src, tmp_path / "out", PrepOptions(fmt="wds", shard_size=96, workers=2))
    with pytest.raises(PrepError, match=r"no column 'img' \(it has: image, label\); name it with --image-column"):
        prepare(src, tmp_path / "out2", PrepOptions(fmt="ffcv", workers=2, image_column="img"))


def test_wds_shards_convert_to_ffcv_where_they_lie(fm_wds, fm_ffcv, tmp_path):
    """A `prep wds` output (or any described shards) as --src of `prep ffcv`: each sample read at its member's
    offset in the tar; the same images per class as converting the tree."""
    out = tmp_path / "ffcv"
    m = prepare(fm_wds, out, PrepOptions(fmt="ffcv", workers=2))
    ours = json.loads((fm_ffcv / "manifest.json").read_text())
    assert {s: m.split(s).per_class for s in ("train", "val")} == {
        s: ours["splits"][s]["per_class"] for s in ("train", "val")}
    assert m.classes == json.loads((fm_wds / "manifest.json").read_text())["classes"]  # names carried over
    assert verify(out) == []
    assert not m.split("train").skipped and not m.split("val").skipped


def test_undescribed_shards_are_refused_with_the_command_that_describes_them(fm_wds, tmp_path):
    import shutil

    bare = tmp_path / "bare"
    bare.mkdir()
    for shard in fm_wds.glob("*.tar"):
        shutil.copy(shard, bare / shard.name)
    with pytest.raises(PrepError, match=f"run `convit-scale prep index {bare}` first"):
        prepare(bare, tmp_path / "out", PrepOptions(fmt="ffcv", workers=2))


def _write_timm_shards(root, tree):
    """The tree as timm's ImageNet shards (tests/test_data_other_tools.py's ``timm_shards``): shuffled samples
    KEY.jpg, KEY.cls and KEY.json in imagenet1k-{train,validation}-NNNN.tar, described by _info.json alone (no
    manifest.json)."""
    import webdataset as wds

    info = {"name": "imagenet-1k", "splits": {}}
    for split, folder in (("train", "train"), ("validation", "val")):
        items = _items(tree, folder)
        random.Random(0).shuffle(items)
        with wds.ShardWriter(str(root / f"imagenet1k-{split}-%04d.tar"), maxcount=300, verbose=0) as sink:
            for i, (path, label) in enumerate(items):
                sink.write({"__key__": f"{split}_{i:08d}", "jpg": path.read_bytes(), "cls": label,
                            "json": {"label": label, "filename": path.name}})
        names = sorted(p.name for p in root.glob(f"imagenet1k-{split}-*.tar"))
        info["splits"][split] = {"name": split, "num_samples": len(items), "filenames": names,
                                 "shard_lengths": [min(300, len(items) - 300 * k) for k in range(len(names))]}
    (root / "_info.json").write_text(json.dumps(info))
    return root


@pytest.fixture(scope="module")
def timm_src(fm_tree, tmp_path_factory):
    return _write_timm_shards(tmp_path_factory.mktemp("timm"), fm_tree)


def _prep(fmt: str, src, out, *options: str) -> dict:
    """`convit-scale prep FMT --src SRC --out OUT` (2 workers, shards of 96); the manifest it wrote."""
    from convit_scale.cli import main

    size = ("--shard-size", "96") if fmt == "wds" else ()
    assert main(["prep", fmt, "--src", str(src), "--out", str(out), "--workers", "2", *size, *options]) == 0
    return json.loads((out / "manifest.json").read_text())


@pytest.fixture(scope="module")
def from_timm(timm_src, tmp_path_factory):
    """`prep wds` and `prep ffcv` of the timm-layout shards: {format: output folder}."""
    out = tmp_path_factory.mktemp("from_timm")
    for fmt in ("wds", "ffcv"):
        _prep(fmt, timm_src, out / fmt)
    return {fmt: out / fmt for fmt in ("wds", "ffcv")}


def test_prep_from_timm_shards_described_by_their_info_json_alone(timm_src, from_timm, fm_tree, fm_wds, fm_ffcv):
    """Shards in timm's layout with no manifest (only _info.json; `validation` serving as val) as --src of `prep wds`
    and `prep ffcv`: every image and label of both splits, read where they lie (the source folder left as it was),
    no class names made up."""
    assert sorted(p.name for p in timm_src.iterdir() if not p.name.endswith(".tar")) == ["_info.json"]
    for fmt, ours in (("wds", fm_wds), ("ffcv", fm_ffcv)):
        m = json.loads((from_timm[fmt] / "manifest.json").read_text())
        want = json.loads((ours / "manifest.json").read_text())
        assert {s: m["splits"][s]["per_class"] for s in ("train", "val")} == {
            s: want["splits"][s]["per_class"] for s in ("train", "val")}, fmt
        assert m["classes"] == [] and not (from_timm[fmt] / "classes.txt").exists()
        assert not m["splits"]["train"]["skipped"] and not m["splits"]["val"]["skipped"]
        assert verify(from_timm[fmt]) == [], fmt
    source = sorted(p.read_bytes() for p, _ in _items(fm_tree, "train") + _items(fm_tree, "val"))
    assert sorted(_members(from_timm["wds"])) == source  # the JPEGs' own bytes, each once
    assert sorted(p.name for p in timm_src.iterdir() if not p.name.endswith(".tar")) == ["_info.json"]
    assert json.loads((from_timm["ffcv"] / "manifest.json").read_text())["splits"]["train"]["images"] == {
        "kept": 1000, "raw": 0, "resized": 0}


def test_prep_from_a_prep_index_out_folder_reads_the_shards_it_names(timm_src, from_timm, tmp_path):
    """`prep index SHARDS --out DIR --label json:label` writes only a manifest in DIR (naming the shards' folder as its
    root); DIR as --src of `prep wds` gives the very shards converting the shards' folder itself gives (the same
    samples, labels and shuffle: the same bytes), and `prep ffcv` the same images per class."""
    from convit_scale.cli import main

    idx = tmp_path / "index"
    assert main(["prep", "index", str(timm_src), "--out", str(idx), "--label", "json:label", "--workers", "2"]) == 0
    assert sorted(p.name for p in idx.iterdir()) == ["manifest.json"]
    wds = _prep("wds", idx, tmp_path / "wds")
    direct = json.loads((from_timm["wds"] / "manifest.json").read_text())
    for split in ("train", "val"):
        assert {n: f["sha256"] for n, f in wds["splits"][split]["files"].items()} == {
            n: f["sha256"] for n, f in direct["splits"][split]["files"].items()}, split
    assert verify(tmp_path / "wds") == []
    ffcv = _prep("ffcv", idx, tmp_path / "ffcv")
    direct = json.loads((from_timm["ffcv"] / "manifest.json").read_text())
    assert {s: ffcv["splits"][s]["per_class"] for s in ("train", "val")} == {
        s: direct["splits"][s]["per_class"] for s in ("train", "val")}
    assert verify(tmp_path / "ffcv") == []
    assert not (timm_src / "manifest.json").exists()


@pytest.mark.parametrize("fmt", ["wds", "ffcv"])
def test_an_interrupted_parquet_conversion_resumes_without_redoing_what_it_finished(parquet_src, tmp_path, fmt):
    """As a tree's (tests/test_data_prep_prepare.py): outputs written before the interruption (recorded in
    .state-SPLIT.json) are not written again, nor are images checked again (.check-SPLIT.json), a half-written temp
    file never counts, and the resumed output is the uninterrupted one, file for file."""
    out = tmp_path / fmt
    opts = PrepOptions(fmt=fmt, shard_size=96, workers=2)
    first = prepare(parquet_src, out, opts).to_dict()
    outputs = sorted(out.glob("*.tar" if fmt == "wds" else "*.beton"))
    assert len(outputs) == (11 + 3 if fmt == "wds" else 2)
    lost = outputs[3] if fmt == "wds" else next(p for p in outputs if p.name.startswith("val"))
    kept = {p.name: p.stat().st_mtime_ns for p in outputs + sorted(out.glob(".check-*.json")) if p != lost}
    assert {".check-train.json", ".check-val.json", ".state-train.json", ".state-val.json"} <= set(
        p.name for p in out.iterdir())
    lost.unlink()  # as if interrupted before it was renamed into place
    (out / "manifest.json").unlink()
    (out / f"{lost.name}.tmp").write_bytes(b"half")
    again = prepare(parquet_src, out, opts).to_dict()
    assert {n: (out / n).stat().st_mtime_ns for n in kept} == kept  # not redone
    assert lost.is_file() and verify(out) == []
    if fmt == "ffcv":  # ffcv's writer places pages as its workers finish: the same samples, not the same bytes
        for split in (first, again):
            for rec in split["splits"]["val"]["files"].values():
                rec.pop("sha256"), rec.pop("bytes", None)
    assert again["splits"] == first["splits"]  # the same files (wds: the same sha256)


def test_a_skipped_samples_reference_is_named_by_its_shard_member(tmp_path):
    """prep's console names a shard's sample by its member (it printed tar:PATH#OFFSET+SIZE references)."""
    import io
    import tarfile as tarmod

    from data_prep.sources import describe

    shard = tmp_path / "s.tar"
    with tarmod.open(shard, "w") as tar:
        for name in ("000000001.jpg", "000000001.cls"):
            info = tarmod.TarInfo(name)
            info.size = 3
            tar.addfile(info, io.BytesIO(b"abc"))
    with tarmod.open(shard) as tar:
        member = tar.getmember("000000001.jpg")
    assert describe(f"tar:{shard}#{member.offset_data:015d}+3") == f"{shard} member 000000001.jpg"
    assert describe("parquet:/d/x.parquet#7/image") == "/d/x.parquet row 7 column image"
    assert describe("/d/train/a/1.JPEG") == "/d/train/a/1.JPEG"
