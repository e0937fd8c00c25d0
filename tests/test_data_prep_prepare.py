"""A conversion end to end (data_prep/prepare.py): bad inputs converted or skipped and listed in the manifest,
--strict and missing sources refused, an interrupted conversion resumed without redoing finished shards."""

import io
import json
import os
import tarfile

import pytest
from PIL import Image
from support import encoded_image, run_cli

from data_prep import PrepError, PrepOptions, prepare, shard_plan, verify


@pytest.fixture()
def messy_tree(tmp_path):
    """An ImageNet-like tree with the real-world oddities of ImageNet, and broken files."""
    root = tmp_path / "src"
    for split, n in (("train", 6), ("val", 2)):
        for c in ("n01", "n02", "n03"):
            (root / split / c).mkdir(parents=True)
            for i in range(n):
                (root / split / c / f"{c}_{i}.JPEG").write_bytes(encoded_image((i * 40, 10, 200)))
    t = root / "train"
    (t / "n01" / "cmyk.JPEG").write_bytes(encoded_image(mode="CMYK"))
    (t / "n01" / "grey.JPEG").write_bytes(encoded_image(mode="L"))
    (t / "n02" / "png_named.JPEG").write_bytes(encoded_image(fmt="PNG"))
    (t / "n02" / "empty.JPEG").write_bytes(b"")
    (t / "n03" / "truncated.JPEG").write_bytes(encoded_image(size=(200, 200))[:300])
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
