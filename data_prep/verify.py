"""``prep verify``: every output file re-read and checked against the manifest (checksums, sample and per-class
counts, label range), and with a source tree, the manifest checked against the tree. FFCV files and WebDataset
shards another tool wrote are checked the same way, against what their own description records."""

from __future__ import annotations

import tarfile
from pathlib import Path

from convit_scale.imagetree import list_classes, scan_split, subsample
from convit_scale.manifest import DataError, Manifest, described, read_ffcv_labels, read_label

from .checks import class_counts, sha256_file


def verify(out: str | Path, src: str | Path | None = None) -> list[str]:
    """Re-read every output file of ``out`` and check it against the manifest; with ``src``, also check the
    manifest against that source tree (:func:`check_source`). Returns the problems found."""
    out = Path(out)
    if not described(str(out)):
        return [f"{out}: no manifest.json (nor timm's _info.json, nor FFCV files); allowed: a `convit-scale prep` "
                f"output, or data another tool wrote that the loaders read in place"]
    try:
        manifest = Manifest.read(out)
    except DataError as e:
        return [str(e)]
    problems = []
    n_classes = manifest.num_classes
    for split, info in manifest.splits.items():
        counts: dict[str, int] = {}
        for name, rec in info.files.items():
            path = manifest.folder / name
            if not path.is_file():
                problems.append(f"{path}: missing")
                continue
            if "sha256" in rec and sha256_file(path) != rec["sha256"]:
                problems.append(f"{path}: checksum differs from the manifest (corrupt or changed)")
            try:
                labels = _read_labels(path, manifest.format, manifest.label_member)
            except Exception as e:  # a truncated tar or beton is reported, not raised
                problems.append(f"{path}: unreadable ({type(e).__name__}: {e})")
                continue
            if len(labels) != rec["samples"]:
                problems.append(f"{path}: {len(labels)} samples, manifest says {rec['samples']}")
            if any(not 0 <= label < n_classes for label in labels):
                problems.append(f"{path}: labels outside 0..{n_classes - 1}")
            for k, v in class_counts(labels).items():
                counts[k] = counts.get(k, 0) + v
        if info.per_class and counts != info.per_class and not any(split in p for p in problems):
            problems.append(f"{split}: samples per class differ from the manifest")
    return problems + (check_source(manifest, Path(src)) if src is not None else [])


def check_source(manifest: Manifest, src: Path) -> list[str]:
    """The manifest accounts for every image of ``src`` it should hold: the same classes, and per split as many
    images written plus listed as skipped as the tree has (after the manifest's subset fraction). Lists files
    only; reads no image."""
    if not (src / "train").is_dir():
        return [f"--src {src}: no train folder (allowed: the ImageNet-style tree the output was converted from)"]
    opts = manifest.options
    classes = list_classes(src / "train")
    if classes != manifest.classes:
        return [f"--src {src}: {len(classes)} class folders in train/, the manifest has {manifest.num_classes} "
                f"classes, or other names (converted from {manifest.source})"]
    problems = []
    for split in opts["splits"]:
        info = manifest.splits.get(split)
        if info is None:
            if (src / split).is_dir():
                problems.append(f"{src / split}: in the source but not in the manifest")
            continue
        samples, unlabelled = scan_split(src, split, classes, _opt_path(opts["val_labels"]),
                                         _opt_path(opts["val_synsets"]))
        if split == "train":
            samples = subsample(samples, opts["subset_fraction"])
        accounted = info.num_samples + len(info.skipped)
        if len(samples) + len(unlabelled) != accounted:
            problems.append(f"{src / split}: {len(samples)} images (subset fraction {opts['subset_fraction']:g}) and "
                            f"{len(unlabelled)} unlabelled file(s), but the manifest accounts for {accounted} "
                            f"({info.num_samples} written, {len(info.skipped)} skipped)")
    return problems


def _opt_path(value: str | None) -> Path | None:
    return Path(value) if value else None


def _read_labels(path: Path, fmt: str, label: str = "cls") -> list[int]:
    if fmt == "ffcv":
        return read_ffcv_labels(path).tolist()
    labels, ext = [], "." + label.partition(":")[0]
    with tarfile.open(path, "r") as tar:
        for member in tar:
            if member.name.endswith(ext):
                labels.append(read_label(tar.extractfile(member).read(), label))
            elif member.name.endswith(".jpg"):
                tar.extractfile(member).read()  # read the bytes: a truncated member raises
    return labels
