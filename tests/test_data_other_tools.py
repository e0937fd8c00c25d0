"""Data other tools wrote, read in place (convit_scale/manifest.py): WebDataset shards in timm's layout, written
with webdataset's own ShardWriter as timm's ImageNet shards are published; and the other way round, `prep wds`'s
shards read by timm's own WebDataset reader."""

import json

import pytest
from support import records, tiny_recipe, train_here

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
        with pytest.raises(DataError, match="no manifest.json .*give the folder timm's _info.json"):
            Manifest.read(timm_shards)
    finally:
        (timm_shards / "_info.bak").rename(timm_shards / "_info.json")


def test_train_and_evaluate_from_timm_shards_without_prep(timm_shards, tmp_path, capsys):
    """The loader, preflight and eval on another tool's shards, as they are: every step's samples are the shards'
    own (labels from .cls), and the whole validation split is evaluated once."""
    out = tmp_path / "run"
    r = tiny_recipe(tmp_path / "r.yaml", "wds", timm_shards, out, schedule={"max_steps": 3},
                    log={"every_steps": 1, "progress": False, "debug_samples": True})
    assert train_here(r) == 0
    ids = [i for rec in records(out, "samples") for i in rec["ids"]]
    assert len(ids) == 3 * 32 and all(str(i).split("/")[0].startswith("imagenet1k-train-") for i in ids), ids[:3]
    assert records(out, "eval")[-1]["samples"] == 200
    res = tmp_path / "eval.json"
    assert main(["eval", "--checkpoint", str(out), "--data", str(timm_shards), "--workers", "0", "--device", "cpu",
                 "--results-file", str(res)]) == 0
    r = json.loads(res.read_text())
    assert r["format"] == "wds" and r["images"] == 200 and {c["class"] for c in r["per_class"]} == {None}


def test_prep_wds_shards_are_read_by_timms_own_reader(fm_wds):
    """`prep wds` writes timm's _info.json beside its manifest: timm's WebDataset reader (what `train.py --dataset
    wds/...` uses) reads the shards, every sample once with its label."""
    from PIL import Image
    from timm.data.readers.reader_wds import ReaderWds

    manifest = Manifest.read(fm_wds)
    for split in ("train", "val"):
        reader = ReaderWds(str(fm_wds), split=split, is_training=False)
        assert len(reader) == manifest.split(split).num_samples
        labels = {}
        for img, target in reader:
            assert isinstance(img, Image.Image)
            labels[target] = labels.get(target, 0) + 1
        assert {str(k): v for k, v in labels.items()} == manifest.split(split).per_class
    assert json.loads((fm_wds / "_info.json").read_text())["splits"]["train"]["filenames"] == [
        f for f, _ in manifest.split("train").shards()]
