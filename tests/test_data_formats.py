"""Which format a data location holds (convit_scale/data/formats.py): the manifest's, or an ImageFolder tree."""

from __future__ import annotations

import json

import pytest

from convit_scale.data import DataError
from convit_scale.data.formats import class_names, detect_format


def test_prepared_folders_and_trees_are_recognised(fm_tree, fm_wds, fm_ffcv):
    assert detect_format(str(fm_wds)) == "wds"
    assert detect_format(str(fm_ffcv)) == "ffcv"
    assert detect_format(str(fm_tree)) == "imagefolder"
    assert detect_format(f"pipe:cat {fm_wds}/{{name}}") == "wds"  # a URL template: its manifest.json is read
    wnids = json.loads((fm_wds / "manifest.json").read_text())["classes"]
    assert class_names(str(fm_wds), "wds") == wnids == class_names(str(fm_tree), "imagefolder")


@pytest.mark.parametrize("make,words", [
    (lambda p: p, ["neither a `convit-scale prep` output (no manifest.json), WebDataset shards with timm's "
                   "_info.json, nor an ImageFolder root",
                   "--format ffcv|wds|imagefolder"]),
    (lambda p: (p / "train").mkdir() or p, ["no class folders in train/"]),
    (lambda p: (p / "f.txt").write_text("") and p / "f.txt", ["not a folder"]),
    (lambda p: (p / "manifest.json").write_text('{"format": "tfrecord"}') and p, ["format 'tfrecord'",
                                                                                    "allowed: ffcv or wds"]),
    (lambda p: (p / "manifest.json").write_text("{broken") and p, ["no readable manifest.json"]),
])
def test_anything_else_is_refused_naming_the_location(make, words, tmp_path):
    location = make(tmp_path)
    with pytest.raises(DataError) as e:
        detect_format(str(location))
    assert str(location) in str(e.value)
    for word in words:
        assert word in str(e.value)
