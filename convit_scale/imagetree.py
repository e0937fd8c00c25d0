"""Scanning an ImageNet-style tree: classes, files, validation labels, and checking every image.

Layout: ``SRC/train/<wnid>/*.JPEG`` and ``SRC/val/`` either in class folders or flat with the ILSVRC2012
ground truth (the Kaggle ``LOC_val_solution.csv``, or the devkit's
``ILSVRC2012_validation_ground_truth.txt`` with a synset list in ILSVRC id order).
Classes are the sorted train folder names, mapped to 0..N-1.
"""

from __future__ import annotations

import csv
import io
import math
from dataclasses import dataclass
from pathlib import Path

from PIL import Image, UnidentifiedImageError

from .errors import BadInput

IMAGE_EXTENSIONS = {".jpeg", ".jpg", ".png", ".bmp", ".webp", ".ppm", ".tif", ".tiff"}


class PrepError(BadInput, RuntimeError):
    """A problem with the source that stops conversion (one line, names the input)."""


@dataclass(frozen=True)
class Sample:
    path: str
    label: int


def list_classes(train_dir: Path) -> list[str]:
    if not train_dir.is_dir():
        raise PrepError(f"source has no train folder: {train_dir}")
    classes = sorted(d.name for d in train_dir.iterdir() if d.is_dir())
    if not classes:
        raise PrepError(f"no class folders in {train_dir}")
    return classes


def is_val_only(root: Path) -> bool:
    """A validation split alone, as timm's validate.py and torchvision's ImageFolder read one: class folders directly
    in ``root`` (``/data/imagenet/val``), no train/ or val/ folder."""
    return (root.is_dir() and not (root / "train").exists() and not (root / "val").exists()
            and any(p.is_dir() for p in root.iterdir()))


def tree_classes(root: Path) -> list[str]:
    """The classes of an ImageFolder tree: its train/ folders, or a val-only tree's own folders (sorted synsets, the
    labels torchvision's ImageFolder gives them)."""
    return list_classes(root if is_val_only(root) else root / "train")


def _files(folder: Path) -> list[Path]:
    return sorted(p for p in folder.iterdir() if p.is_file() and p.suffix.lower() in IMAGE_EXTENSIONS)


def subsample(samples: list[Sample], fraction: float) -> list[Sample]:
    """Table 2: keep the first floor(n_c * f) files of each class, in sorted file order."""
    if fraction >= 1.0:
        return samples
    by_class: dict[int, list[Sample]] = {}
    for s in samples:
        by_class.setdefault(s.label, []).append(s)
    kept = []
    for label in sorted(by_class):
        files = sorted(by_class[label], key=lambda s: s.path)
        kept += files[: math.floor(len(files) * fraction)]
    return kept


def scan_class_folders(split_dir: Path, classes: list[str]) -> tuple[list[Sample], list[dict]]:
    """Samples of ``split_dir/<class>/*``; empty class folders and unknown folders are reported."""
    index = {c: i for i, c in enumerate(classes)}
    samples, problems = [], []
    for d in sorted(p for p in split_dir.iterdir() if p.is_dir()):
        if d.name not in index:
            problems.append({"path": str(d), "reason": "class folder not among the train classes"})
            continue
        files = _files(d)
        if not files:
            problems.append({"path": str(d), "reason": "empty class folder"})
        samples += [Sample(str(f), index[d.name]) for f in files]
    return samples, problems


def _read_val_labels(val_dir: Path, classes: list[str], labels_file: Path | None,
                     synsets_file: Path | None) -> dict[str, int]:
    """Flat val: map file stem -> label from LOC_val_solution.csv or the devkit ground truth."""
    index = {c: i for i, c in enumerate(classes)}
    if labels_file is None:
        for cand in (val_dir / "LOC_val_solution.csv", val_dir.parent / "LOC_val_solution.csv"):
            if cand.is_file():
                labels_file = cand
    if labels_file is None:
        raise PrepError(f"{val_dir} is flat: pass --val-labels (LOC_val_solution.csv or the devkit ground truth)")
    labels_file = Path(labels_file)
    if not labels_file.is_file():
        raise PrepError(f"validation labels file not found: {labels_file}")
    out: dict[str, int] = {}
    if labels_file.suffix == ".csv":
        with labels_file.open() as f:
            for row in csv.DictReader(f):
                wnid = row["PredictionString"].split()[0]
                if wnid not in index:
                    raise PrepError(f"{labels_file}: synset {wnid} of {row['ImageId']} is not a train class")
                out[row["ImageId"]] = index[wnid]
        return out
    # Devkit: line k holds the 1-based ILSVRC id of the k-th file in sorted order.
    if synsets_file is None or not Path(synsets_file).is_file():
        raise PrepError(f"{labels_file}: the devkit ground truth needs --val-synsets (wnids in ILSVRC id order)")
    synsets = [line.split()[0] for line in Path(synsets_file).read_text().split("\n") if line.strip()]
    ids = [int(line) for line in labels_file.read_text().split()]
    files = _files(val_dir)
    if len(files) != len(ids):
        raise PrepError(f"{labels_file}: {len(ids)} labels for {len(files)} files in {val_dir}")
    for f, ilsvrc_id in zip(files, ids):
        wnid = synsets[ilsvrc_id - 1]
        if wnid not in index:
            raise PrepError(f"{synsets_file}: synset {wnid} is not a train class")
        out[f.stem] = index[wnid]
    return out


def scan_split(src: Path, split: str, classes: list[str], val_labels: Path | None = None,
               val_synsets: Path | None = None) -> tuple[list[Sample], list[dict]]:
    split_dir = src / split
    if not split_dir.is_dir():
        raise PrepError(f"source has no {split} folder: {split_dir}")
    if any(p.is_dir() for p in split_dir.iterdir()):
        return scan_class_folders(split_dir, classes)
    labels = _read_val_labels(split_dir, classes, val_labels, val_synsets)
    samples, problems = [], []
    for f in _files(split_dir):
        if f.stem in labels:
            samples.append(Sample(str(f), labels[f.stem]))
        else:
            problems.append({"path": str(f), "reason": "no ground-truth label"})
    return samples, problems


def load_rgb_jpeg(path: str, quality: int = 95) -> tuple[bytes | None, str | None, bool]:
    """(JPEG bytes of an RGB image, skip reason, converted?).

    ImageNet holds CMYK and greyscale JPEGs and a PNG named .JPEG: those are converted to RGB and
    re-encoded; plain RGB JPEGs keep their original bytes. Empty, truncated or undecodable files
    give a reason instead of bytes.
    """
    return rgb_jpeg(Path(path).read_bytes(), quality)


def undecodable(e: BaseException) -> str:
    """A skip reason from PIL's error. Its ``UnidentifiedImageError`` names the in-memory buffer it was given
    (``<_io.BytesIO object at 0x...>``), which says nothing: the reason says what the loaders' says (the caller names
    the file or member)."""
    text = "cannot identify image data" if isinstance(e, UnidentifiedImageError) else str(e)
    return f"undecodable: {type(e).__name__}: {text}".replace("\n", " ")


def rgb_jpeg(data: bytes, quality: int = 95) -> tuple[bytes | None, str | None, bool]:
    """``load_rgb_jpeg`` of an image's bytes (from a file, a tar member or a Parquet cell)."""
    if not data:
        return None, "empty file", False
    try:
        with Image.open(io.BytesIO(data)) as img:
            img.load()  # a truncated JPEG raises here
            if img.format == "JPEG" and img.mode == "RGB":
                return data, None, False
            rgb = img.convert("RGB")
    except (UnidentifiedImageError, OSError, SyntaxError, ValueError) as e:
        return None, undecodable(e), False
    buf = io.BytesIO()
    rgb.save(buf, format="JPEG", quality=quality)
    return buf.getvalue(), None, True
