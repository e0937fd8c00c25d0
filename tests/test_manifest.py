"""convit_scale/manifest.py: the one manifest type prep writes and every reader reads, and its refusals."""

import json

import pytest

from convit_scale.manifest import MANIFEST, DataError, Manifest, Split


def _manifest(tmp_path, **options) -> Manifest:
    split = Split(5, {"0": 3, "2": 2}, {"train/train-000000.tar": {"samples": 5, "sha256": "x", "bytes": 10}},
                  [{"path": "a.JPEG", "reason": "empty file"}], {"images": {"kept": 5}})
    return Manifest("wds", "/src", {"subset_fraction": 1.0, **options}, ["a", "b", "c"], {"train": split},
                    str(tmp_path))


def test_written_and_read_back_the_same(tmp_path):
    m = _manifest(tmp_path)
    path = m.write(tmp_path)
    assert path == tmp_path / MANIFEST and json.loads(path.read_text()) == m.to_dict()
    back = Manifest.read(tmp_path)
    assert back == m and back.split("train").extra == {"images": {"kept": 5}}  # what the reader does not know stays
    assert back.split("train").class_counts(back.num_classes) == [3, 0, 2]
    assert back.split("train").shards() == [("train/train-000000.tar", 5)]


def test_refusals_name_the_location_and_what_is_allowed(tmp_path):
    with pytest.raises(DataError, match=f"{tmp_path}: no manifest.json \\(not found\\); convert with `convit-scale "
                                        f"prep`"):
        Manifest.read(tmp_path)
    (tmp_path / MANIFEST).write_text("{broken")
    with pytest.raises(DataError, match="no readable manifest.json"):
        Manifest.read(tmp_path)
    (tmp_path / MANIFEST).write_text(json.dumps({"format": "tfrecord", "classes": []}))
    with pytest.raises(DataError, match="not a prep manifest \\(format 'tfrecord'; allowed: ffcv or wds\\)"):
        Manifest.read(tmp_path)
    (tmp_path / MANIFEST).write_text(json.dumps({"format": "wds"}))
    with pytest.raises(DataError, match="not a prep manifest \\(no 'classes'\\)"):
        Manifest.read(tmp_path)
    m = _manifest(tmp_path)
    with pytest.raises(DataError, match=f"{tmp_path}: manifest has no 'val' split; .*it has: train"):
        m.split("val")
    _manifest(tmp_path, subset_fraction=0.1).require_subset(0.1)
    with pytest.raises(DataError, match="shards hold subset_fraction=0.1, the recipe asks 0.5; convert with "
                                        "`convit-scale prep wds --subset-fraction 0.5`"):
        _manifest(tmp_path, subset_fraction=0.1).require_subset(0.5)


def test_a_url_location_reads_through_webdataset(tmp_path):
    _manifest(tmp_path).write(tmp_path)
    assert Manifest.read(f"pipe:cat {tmp_path}/{{name}}").classes == ["a", "b", "c"]
