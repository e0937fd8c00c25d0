"""The embedded real dataset: Fashion-MNIST (Debian's ``dataset-fashion-mnist``) as an ImageNet-style tree.

70,000 real 28x28 greyscale photographs of clothing, 10 classes (MIT licence). Written as
``OUT/train/<class>/<index>.JPEG`` and ``OUT/val/<class>/<index>.JPEG`` so the same converters and
loaders as ImageNet's are used on it.
"""

from __future__ import annotations

import gzip
from pathlib import Path

import numpy as np
from PIL import Image

from convit_scale.files import atomic_path
from convit_scale.imagetree import PrepError

DEFAULT_SOURCE = Path("/usr/share/datasets/fashion-mnist")
CLASSES = ["t_shirt_top", "trouser", "pullover", "dress", "coat", "sandal", "shirt", "sneaker", "bag", "ankle_boot"]
FILES = {"train": ("train-images-idx3-ubyte.gz", "train-labels-idx1-ubyte.gz"),
         "val": ("t10k-images-idx3-ubyte.gz", "t10k-labels-idx1-ubyte.gz")}


def _read_idx(path: Path) -> np.ndarray:
    with gzip.open(path, "rb") as f:
        data = f.read()
    ndim = data[3]
    dims = [int.from_bytes(data[4 + 4 * i: 8 + 4 * i], "big") for i in range(ndim)]
    return np.frombuffer(data, dtype=np.uint8, offset=4 + 4 * ndim).reshape(dims)


def build_tree(out: str | Path, per_class: dict[str, int] | None = None, source: Path = DEFAULT_SOURCE) -> Path:
    """Write the tree (first ``per_class[split]`` images of each class, all if None). Idempotent."""
    out = Path(out)
    for split, (img_file, lbl_file) in FILES.items():
        if not (source / img_file).is_file():
            raise PrepError(f"Fashion-MNIST not found in {source}: install Debian's dataset-fashion-mnist")
        done = out / split / ".complete"
        limit = (per_class or {}).get(split)
        if done.is_file() and done.read_text() == str(limit):
            continue
        images, labels = _read_idx(source / img_file), _read_idx(source / lbl_file)
        counts = {c: 0 for c in range(len(CLASSES))}
        for c in CLASSES:
            (out / split / c).mkdir(parents=True, exist_ok=True)
        for i, (img, label) in enumerate(zip(images, labels)):
            label = int(label)
            if limit is not None and counts[label] >= limit:
                continue
            counts[label] += 1
            path = out / split / CLASSES[label] / f"{i:05d}.JPEG"
            if not path.exists():
                with atomic_path(path, fsync=False) as tmp:  # 70,000 small files, rebuilt if lost
                    Image.fromarray(img, mode="L").convert("RGB").save(tmp, format="JPEG", quality=95)
        done.write_text(str(limit))
    return out
