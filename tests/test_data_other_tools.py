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
        with pytest.raises(DataError, match="WebDataset shards without manifest.json or timm's _info.json; describe "
                                            "them once with `convit-scale prep index"):
            Manifest.read(timm_shards)
        with pytest.raises(DataError, match="describe them once with `convit-scale prep index"):
            detect_format(str(timm_shards))
    finally:
        (timm_shards / "_info.bak").rename(timm_shards / "_info.json")


def test_train_resume_evaluate_and_analyse_timm_shards_without_prep(timm_shards, tmp_path, capsys):
    """The loader, preflight, eval and analyze on another tool's shards, as they are: every step's samples are the
    shards' own (labels from .cls), a run of 2 steps on 1 rank continues on 2 ranks with none of its samples twice,
    and the whole validation split is evaluated once."""
    from support import run_ranks

    out = tmp_path / "run"
    r = tiny_recipe(tmp_path / "r.yaml", "wds", timm_shards, out, schedule={"max_steps": 2},
                    checkpoint={"every_steps": 2}, log={"every_steps": 1, "progress": False, "debug_samples": True})
    assert train_here(r) == 0
    res = run_ranks(r, "schedule.max_steps=4")
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
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
    DatasetWriter(str(path), spec, num_workers=2).from_indexed_dataset(WithExtra(ImageFolder(str(tree / split))))
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


def test_train_resume_on_two_ranks_evaluate_analyse_and_verify_ffcv_imagenet_files(ffcv_imagenet, fm_tree, tmp_path):
    """ffcv-imagenet's files as they are: a run of 2 steps on 1 rank resumed on 2 ranks continues the same samples,
    a Table 2 subset takes the first images of each class, eval and analyze read the val file, and `prep verify`
    checks them."""
    from support import run_ranks

    from convit_scale.config import DataConfig
    from convit_scale.data import LoaderSpec, build_loader

    out = tmp_path / "run"
    r = tiny_recipe(tmp_path / "r.yaml", "ffcv", ffcv_imagenet, out, schedule={"max_steps": 2},
                    checkpoint={"every_steps": 2}, log={"every_steps": 1, "progress": False, "debug_samples": True},
                    data={"val_path": str(ffcv_imagenet / "val_32_0.50_90.ffcv")})
    assert train_here(r) == 0
    res = run_ranks(r, "schedule.max_steps=4")
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
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
