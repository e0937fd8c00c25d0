"""`prep verify` (data_prep/verify.py): a file that no longer matches the manifest's checksum is named; the loader
refuses the same truncated shard while training. Data other tools wrote is verified where it lies: timm-layout
shards (no class count), shards indexed behind a URL template (streamed), FFCV files with other field names."""

import json
import shutil

import pytest
from support import run_cli

from convit_scale.cli import main
from convit_scale.config import DataConfig
from convit_scale.data import DataError, LoaderSpec, build_loader
from convit_scale.manifest import Manifest
from data_prep import PrepOptions, prepare, verify


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


def _timm_shards(root, tree, cls: bool = True):
    """``tree`` as timm's ImageNet shards (webdataset's ShardWriter; KEY.jpg, KEY.cls unless not ``cls``, KEY.json
    with the label): `train` and `validation` splits and _info.json, no manifest.json."""
    import webdataset as wds

    root.mkdir()
    classes = sorted(p.name for p in (tree / "train").iterdir() if p.is_dir())
    info = {"name": "imagenet-1k", "splits": {}}
    for split, folder in (("train", "train"), ("validation", "val")):
        items = [(p, label) for label, c in enumerate(classes) for p in sorted((tree / folder / c).iterdir())]
        with wds.ShardWriter(str(root / f"imagenet1k-{split}-%04d.tar"), maxcount=400, verbose=0) as sink:
            for i, (path, label) in enumerate(items):
                sink.write({"__key__": f"{split}_{i:08d}", "jpg": path.read_bytes(), "json": {"label": label},
                            **({"cls": label} if cls else {})})
        names = sorted(p.name for p in root.glob(f"imagenet1k-{split}-*.tar"))
        info["splits"][split] = {"name": split, "num_samples": len(items), "filenames": names,
                                 "shard_lengths": [min(400, len(items) - 400 * k) for k in range(len(names))]}
    (root / "_info.json").write_text(json.dumps(info))
    return root


@pytest.fixture(scope="module")
def timm_shards(fm_tree, tmp_path_factory):
    return _timm_shards(tmp_path_factory.mktemp("verify") / "timm", fm_tree)


def test_verify_timm_layout_shards_whose_class_count_is_unknown(timm_shards, capsys):
    """timm's _info.json records no class count: verify checks labels >= 0 only and says the count is unknown (it
    reported every shard 'labels outside 0..-1')."""
    assert verify(timm_shards) == []
    notes = []
    assert verify(timm_shards, notes=notes) == []
    assert len(notes) == 1 and "class count is unknown" in notes[0] and "labels checked to be >= 0 only" in notes[0]
    assert main(["prep", "verify", str(timm_shards)]) == 0
    captured = capsys.readouterr()
    assert "note:" in captured.err and "class count is unknown" in captured.err and "error:" not in captured.err
    n = sum(s["num_samples"] for s in json.loads((timm_shards / "_info.json").read_text())["splits"].values())
    assert captured.out.strip() == (f"verified {timm_shards}: no manifest.json: every shard read against timm's "
                                    f"_info.json (samples, labels); {n} of {n} images decoded")


def test_verify_without_a_manifest_decodes_the_images_and_names_those_that_fail(fm_tree, tmp_path, capsys,
                                                                                 monkeypatch):
    """Shards described by timm's _info.json alone, two JPEGs in them that do not decode: verify decodes the images
    and names each failure by shard and member (it said 'every file matches the manifest', with no manifest)."""
    import sys

    import webdataset as wds

    verify_module = sys.modules["data_prep.verify"]  # the module (the package's `verify` is its function)
    good = sorted((fm_tree / "val").glob("*/*.JPEG"))[:4]
    payloads = [p.read_bytes() for p in good] + [good[0].read_bytes()[:300], b"not an image"]
    root = tmp_path / "corrupt"
    root.mkdir()
    with wds.TarWriter(str(root / "imagenet1k-validation-0000.tar")) as sink:
        for i, data in enumerate(payloads):
            sink.write({"__key__": f"v{i}", "jpg": data, "cls": 0})
    (root / "_info.json").write_text(json.dumps({"splits": {"validation": {
        "name": "validation", "num_samples": 6, "filenames": ["imagenet1k-validation-0000.tar"],
        "shard_lengths": [6]}}}))
    assert main(["prep", "verify", str(root)]) == 1
    captured = capsys.readouterr()
    errors = [line for line in captured.err.splitlines() if line.startswith("error: ")]
    assert len(errors) == 2 and all("imagenet1k-validation-0000.tar: member" in e for e in errors), errors
    assert "member v4.jpg does not decode (undecodable: OSError" in errors[0]
    assert "member v5.jpg does not decode (undecodable:" in errors[1] and "BytesIO" not in errors[1]
    assert captured.out.strip() == (f"{root}: 2 problem(s) (no manifest.json: every shard read against timm's "
                                    f"_info.json (samples, labels); 6 of 6 images decoded)")
    monkeypatch.setattr(verify_module, "DECODE_SAMPLE", 3)  # every other image: v0, v2, v4
    checked = []
    problems = verify_module.verify(root, checked=checked)
    assert [p.split(": member ")[1].split()[0] for p in problems] == ["v4.jpg"]
    assert checked[0].endswith("3 of 6 images decoded (a sample)")


def test_num_classes_of_shards_whose_class_count_is_unknown_names_prep_index(timm_shards):
    """data.num_classes on timm-layout shards: refused saying the count is unknown and naming `prep index`, which
    counts it (it said 'shards hold 0 classes')."""
    with pytest.raises(DataError, match=r"class count is unknown .*data.num_classes = 4; describe them with "
                                        r"`convit-scale prep index .*--out DIR` \(it counts the classes"):
        Manifest.read(timm_shards).require_classes(4)
    Manifest.read(timm_shards).require_classes(None)


def test_timm_layout_samples_without_cls_name_the_command_that_reads_their_json(fm_tree, tmp_path):
    """Samples whose labels are only in KEY.json (no .cls member) are refused while training naming the command
    that reads them there."""
    no_cls = _timm_shards(tmp_path / "no_cls", fm_tree, cls=False)
    d = DataConfig(format="wds", train_path=str(no_cls), val_path=str(no_cls), num_workers=0, repeated_aug=1)
    with pytest.raises(DataError, match=r"no \.cls member; if the labels are in KEY\.json, describe the shards "
                                        r"with `convit-scale prep index SRC --label json:FIELD --out DIR`"):
        for _ in build_loader(d, LoaderSpec("val", 16, 10)).epoch(0):
            pass


def test_verify_streams_shards_indexed_or_described_behind_a_url_template(fm_tree, fm_wds, tmp_path):
    """Shards indexed where they lie behind a URL template (`prep index` of a `pipe:` template), and a `prep wds`
    output read through one, are streamed as the loaders stream them (verify reported every shard 'missing', a path
    made of the template): counts, labels and checksums checked; a shard the command cannot read, or a changed one,
    is named."""
    from data_prep.index import index

    shards = _timm_shards(tmp_path / "timm", fm_tree)  # its own: a shard is removed
    remote = f"pipe:cat {shards}/{{name}}"
    index(remote, tmp_path / "idx", shards="imagenet1k-train-{0000..0002}.tar", workers=2)
    assert verify(tmp_path / "idx") == []
    (shards / "imagenet1k-train-0001.tar").unlink()
    problems = verify(tmp_path / "idx")
    assert len(problems) == 1 and "imagenet1k-train-0001.tar: unreadable (OSError: exit status 1" in problems[0]

    copy = tmp_path / "wds"
    shutil.copytree(fm_wds, copy)
    assert verify(f"pipe:cat {copy}/{{name}}") == []
    shard = sorted(copy.glob("train-*.tar"))[2]
    data = bytearray(shard.read_bytes())
    data[-5000] ^= 0xFF  # a byte of the last member's image (or the tar's end blocks): the tar still reads
    shard.write_bytes(bytes(data))
    problems = verify(f"pipe:cat {copy}/{{name}}")
    assert problems == [f"pipe:cat {shard}: checksum differs from the manifest (corrupt or changed)"]


def test_verify_ffcv_files_with_other_field_names(tmp_path, capsys):
    """FFCV files whose fields have other names: `prep verify --ffcv-fields '[img, target]'` (the recipe's
    data.ffcv_fields syntax) checks them; without it the refusal names that option."""
    import numpy as np

    from convit_scale.ffcv_threads import importing_ffcv

    with importing_ffcv():
        from ffcv.fields import IntField, RGBImageField
        from ffcv.writer import DatasetWriter

    class Images:
        def __len__(self):
            return 24

        def __getitem__(self, i):
            return np.full((8, 8, 3), i, np.uint8), i % 4

    path = tmp_path / "val_8_raw.ffcv"
    DatasetWriter(str(path), {"img": RGBImageField(write_mode="raw"), "target": IntField()},
                  num_workers=1).from_indexed_dataset(Images())
    (problem,) = verify(tmp_path)
    assert "no 'image' image field" in problem and "`prep verify`: --ffcv-fields" in problem
    assert verify(tmp_path, ffcv_fields=("img", "target")) == []
    capsys.readouterr()
    assert main(["prep", "verify", str(tmp_path), "--ffcv-fields", "[img, target]"]) == 0
    assert main(["prep", "verify", str(tmp_path)]) == 1
    assert "--ffcv-fields" in capsys.readouterr().err
    assert main(["prep", "verify", str(tmp_path), "--ffcv-fields", "[img]"]) != 0
    assert "'[img]': allowed: the image and label fields' names" in capsys.readouterr().err
