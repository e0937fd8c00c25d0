"""The image tree of a class-per-folder dataset (convit_scale/imagetree.py): its class folders scanned, Table 2's
subsets, a flat val/ folder labelled by the Kaggle solution file or the devkit's ground truth."""

from __future__ import annotations

import pytest
from support import encoded_image

from convit_scale.imagetree import subsample
from data_prep import PrepError, PrepOptions, prepare


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


def _flat_val_tree(root, val_names):
    """Two train classes (n01, n02) of one image each and a flat val/ folder with these file names."""
    for c in ("n01", "n02"):
        (root / "train" / c).mkdir(parents=True)
        (root / "train" / c / "a.JPEG").write_bytes(encoded_image())
    (root / "val").mkdir()
    for name in val_names:
        (root / "val" / name).write_bytes(encoded_image())
    return root


def test_flat_val_with_kaggle_labels(tmp_path):
    root = _flat_val_tree(tmp_path / "src", [f"ILSVRC2012_val_{i:08d}.JPEG" for i in range(3)])
    (root / "LOC_val_solution.csv").write_text("ImageId,PredictionString\n" + "".join(
        f"ILSVRC2012_val_{i:08d},{w} 1 2 3 4\n" for i, w in enumerate(["n02", "n01", "n02"])))
    m = prepare(root, tmp_path / "o", PrepOptions(fmt="wds", workers=1)).to_dict()
    assert m["splits"]["val"]["per_class"] == {"0": 1, "1": 2}


def test_flat_val_with_devkit_ground_truth(tmp_path):
    root = _flat_val_tree(tmp_path / "src", [f"ILSVRC2012_val_{i + 1:08d}.JPEG" for i in range(3)])
    # ILSVRC ids are 1-based positions in the synset list, which is not the sorted class order
    (tmp_path / "synsets.txt").write_text("n02 thing two\nn01 thing one\n")
    (tmp_path / "gt.txt").write_text("1\n2\n1\n")
    m = prepare(root, tmp_path / "o", PrepOptions(fmt="wds", workers=1, val_labels=str(tmp_path / "gt.txt"),
                                                  val_synsets=str(tmp_path / "synsets.txt")))
    assert m.split("val").per_class == {"0": 1, "1": 2}  # n01 -> 0 once, n02 -> 1 twice
    with pytest.raises(PrepError, match="needs --val-synsets"):
        prepare(root, tmp_path / "o2", PrepOptions(fmt="wds", workers=1, val_labels=str(tmp_path / "gt.txt")))
