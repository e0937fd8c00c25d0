"""The embedded Fashion-MNIST (data_prep/fashion_mnist.py): an ImageNet-style tree of the first N images of each
class, RGB JPEGs of the source's own pixels, written once (a second call with the same counts writes nothing)."""

from __future__ import annotations

import numpy as np
import pytest
from PIL import Image

from convit_scale.imagetree import PrepError
from data_prep.fashion_mnist import CLASSES, DEFAULT_SOURCE, FILES, _read_idx, build_tree


def test_the_first_images_of_each_class_as_rgb_jpegs(tmp_path):
    root = build_tree(tmp_path / "tree", {"train": 3, "val": 2})
    assert sorted(p.name for p in (root / "train").iterdir() if p.is_dir()) == sorted(CLASSES)
    images, labels = _read_idx(DEFAULT_SOURCE / FILES["train"][0]), _read_idx(DEFAULT_SOURCE / FILES["train"][1])
    assert images.shape == (60000, 28, 28) and set(labels.tolist()) == set(range(10))
    for label, name in enumerate(CLASSES):
        files = sorted((root / "train" / name).iterdir())
        first = [i for i in range(len(labels)) if labels[i] == label][:3]
        assert [f.name for f in files] == [f"{i:05d}.JPEG" for i in first]
        with Image.open(files[0]) as img:
            assert img.format == "JPEG" and img.mode == "RGB" and img.size == (28, 28)
            grey = np.asarray(img.convert("L"), dtype=np.int16)
        assert np.abs(grey - images[first[0]]).mean() < 2  # the source's pixels, up to JPEG at quality 95
        assert len(list((root / "val" / name).iterdir())) == 2
    mtimes = {p: p.stat().st_mtime_ns for p in root.rglob("*.JPEG")}
    build_tree(root, {"train": 3, "val": 2})
    assert {p: p.stat().st_mtime_ns for p in root.rglob("*.JPEG")} == mtimes


def test_a_missing_source_is_named(tmp_path):
    with pytest.raises(PrepError, match="Fashion-MNIST not found in .*nowhere: install Debian's dataset-fashion"):
        build_tree(tmp_path / "tree", source=tmp_path / "nowhere")
