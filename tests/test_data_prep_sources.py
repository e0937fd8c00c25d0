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
