"""Which format a data location holds, read from the location itself: a `convit-scale prep` output says so in
its manifest.json; FFCV files (.ffcv, .beton) and timm's WebDataset folders by their files; an ImageFolder tree is a
folder whose train/ holds class folders."""

from __future__ import annotations

from pathlib import Path

from ..imagetree import is_val_only, tree_classes
from ..manifest import TIMM_INFO, Manifest, described, ffcv_files
from .faults import DataError

FORMATS = ("ffcv", "wds", "imagefolder")


def detect_format(location: str) -> str:
    """``manifest.json``'s format (a local folder, or a WebDataset URL template with ``{name}``), ``wds`` for a
    folder of WebDataset shards with timm's ``_info.json``, else ``imagefolder`` for an ImageNet-style tree
    (``train/<class>/``) or a validation split alone (class folders in the location, ``imagetree.is_val_only``).
    Anything else is a DataError naming the location and what was looked for."""

    local = "{name}" not in location
    if ffcv_files(location):
        return "ffcv"
    if local and not Path(location).is_dir():
        raise DataError(f"{location}: not a folder; allowed: a `convit-scale prep` output (with manifest.json), an "
                        f"ImageFolder root (train/ and val/ class folders), FFCV files (.ffcv, .beton) or a "
                        f"WebDataset URL template with {{name}}")
    if local and not described(location):
        train = Path(location) / "train"
        if train.is_dir() and any(p.is_dir() for p in train.iterdir()) or is_val_only(Path(location)):
            return "imagefolder"
        if any(Path(location).glob("*.tar")):
            Manifest.read(location)  # refuses shards without a description, naming `prep index`
        raise DataError(f"{location}: neither a `convit-scale prep` output (no manifest.json), WebDataset shards "
                        f"with timm's {TIMM_INFO}, nor an ImageFolder root (no class folders in train/); name the "
                        f"format with --format {'|'.join(FORMATS)}")
    return Manifest.read(location).format  # refuses a format prep does not write


def class_names(location: str, fmt: str) -> list[str] | None:
    """The class of each label (ImageNet wnids): the manifest's, or the sorted train folders of an ImageFolder
    root; None when the location does not say."""
    if fmt == "imagefolder":
        return tree_classes(Path(location))

    try:
        return Manifest.read(location).classes or None  # FFCV files and timm's shards name no classes
    except DataError:
        return None
