"""The image tree of a class-per-folder dataset (convit_scale/imagetree.py): its class folders scanned, Table 2's
subsets."""

from __future__ import annotations

import pytest

from convit_scale.imagetree import subsample


def test_table2_subset_keeps_first_files_per_class():
    from convit_scale.imagetree import Sample

    samples = [Sample(f"c{c}/{i:03d}.JPEG", c) for c in range(3) for i in (5, 1, 9, 3, 7, 2, 8)]
    kept = subsample(samples, 0.3)  # floor(7 * 0.3) = 2 per class, the first in sorted order
    assert [s.path for s in kept] == ["c0/001.JPEG", "c0/002.JPEG", "c1/001.JPEG", "c1/002.JPEG",
                                      "c2/001.JPEG", "c2/002.JPEG"]


def test_class_folders_are_scanned_in_order_and_odd_folders_reported(tmp_path):
    from convit_scale.imagetree import PrepError, list_classes, scan_class_folders

    train, val = tmp_path / "train", tmp_path / "val"
    for split, folder, files in ((train, "n02", ["b.JPEG", "a.jpg", "notes.txt"]), (train, "n01", ["x.png"]),
                                 (val, "n01", ["v.JPEG"]), (val, "n02", []), (val, "n99", ["w.JPEG"])):
        (split / folder).mkdir(parents=True)
        for name in files:
            (split / folder / name).write_bytes(b"")
    classes = list_classes(train)
    assert classes == ["n01", "n02"]
    samples, problems = scan_class_folders(train, classes)
    assert [(s.path.removeprefix(str(train) + "/"), s.label) for s in samples] == [
        ("n01/x.png", 0), ("n02/a.jpg", 1), ("n02/b.JPEG", 1)]  # images only, sorted
    assert problems == []
    samples, problems = scan_class_folders(val, classes)
    assert [s.label for s in samples] == [0]
    assert problems == [{"path": str(val / "n02"), "reason": "empty class folder"},
                        {"path": str(val / "n99"), "reason": "class folder not among the train classes"}]
    with pytest.raises(PrepError, match="no train folder"):
        list_classes(tmp_path / "missing")
