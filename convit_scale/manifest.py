"""A prepared dataset's ``manifest.json``: the one type ``convit-scale prep`` writes (last, atomically) and every
reader reads (the loaders, preflight, ``prep verify``, format detection, the benchmarks).

A manifest records the format, the source and the options of the conversion, the class of each label, and per
split the samples per class, the files with their samples, checksum and size, and the inputs that were skipped::

    {"format": "wds", "source": "/data/imagenet", "options": {...}, "classes": ["n01440764", ...],
     "splits": {"train": {"num_samples": 1281167, "per_class": {"0": 1300, ...},
                          "files": {"train/train-000000.tar": {"samples": 1000, "sha256": "...", "bytes": ...}},
                          "skipped": [{"path": ..., "reason": ...}]}}}

Files are named relative to the dataset's folder; ``per_class`` keys are labels as strings (JSON's keys).
A location is a local folder or a WebDataset URL template with ``{name}`` (``pipe:...{name}``, ``https://...``).

WebDataset shards in timm's layout (``KEY.jpg`` and ``KEY.cls`` samples, and ``_info.json`` listing each split's
files and shard lengths, as timm's ImageNet shards are published) are read in place: a folder with ``_info.json``
and no ``manifest.json`` gives a manifest of its own (the shards and their lengths; no class names, no per-class
counts, which such a folder does not record; ``validation`` serves as ``val``). ``prep wds`` writes ``_info.json``
beside its manifest, so that timm's WebDataset reader takes its shards as they are.

It sits below ``data/`` and ``data_prep/`` (both read it; a conversion's worker processes import no torch), with
:class:`DataError`, the one error of unusable data, which ``data/`` re-exports.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path

from .files import write_json_atomic


class DataError(RuntimeError):
    """Unusable data (missing files, a truncated shard, a manifest mismatch): one line naming the input."""


MANIFEST = "manifest.json"
TIMM_INFO = "_info.json"
"""timm's description of a WebDataset folder (``timm.data.readers.reader_wds``)."""
FORMATS = ("ffcv", "wds")
"""The formats ``convit-scale prep`` writes."""
SPLIT_ALIASES = {"val": ("validation",)}
"""Other names of a split in other tools' layouts (timm's ImageNet shards name it ``validation``)."""


@dataclass
class Split:
    """One split of a prepared dataset."""

    num_samples: int
    per_class: dict[str, int]
    """Samples per label (the label as a string, as JSON keys are)."""
    files: dict[str, dict]
    """File name (relative to the dataset's folder) -> {"samples", "sha256", "bytes", ...}."""
    skipped: list[dict] = field(default_factory=list)
    """Inputs left out at conversion: {"path", "reason"}."""
    extra: dict = field(default_factory=dict)
    """Anything else the writer recorded (e.g. how FFCV stored the images), kept as it is."""

    def class_counts(self, num_classes: int) -> list[int]:
        """Samples of each label 0..num_classes-1 (0 for a label the split lacks)."""
        return [self.per_class.get(str(c), 0) for c in range(num_classes)]

    def shards(self) -> list[tuple[str, int]]:
        """(file name, samples) of each file, in name order (WebDataset's shard order)."""
        return [(name, rec["samples"]) for name, rec in sorted(self.files.items())]

    def to_dict(self) -> dict:
        return {"num_samples": self.num_samples, "per_class": self.per_class, "files": self.files,
                "skipped": self.skipped, **self.extra}

    @classmethod
    def from_dict(cls, d: dict) -> "Split":
        known = {"num_samples", "per_class", "files", "skipped"}
        return cls(int(d["num_samples"]), dict(d["per_class"]), dict(d["files"]), list(d.get("skipped", [])),
                   {k: v for k, v in d.items() if k not in known})


@dataclass
class Manifest:
    """A prepared dataset (the module says what each part records)."""

    format: str
    source: str
    options: dict
    classes: list[str]
    splits: dict[str, Split] = field(default_factory=dict)
    location: str = ""
    """Where it was read from (errors name it); not written."""

    @property
    def num_classes(self) -> int:
        return len(self.classes)

    @property
    def subset_fraction(self) -> float:
        """The fraction of each class the conversion kept (Table 2 subsets made at conversion; 1.0: all)."""
        return float(self.options.get("subset_fraction", 1.0))

    def split(self, name: str) -> Split:
        """The split ``name`` (or its other name, ``SPLIT_ALIASES``), or a DataError naming the location and the
        splits it has."""
        for candidate in (name, *SPLIT_ALIASES.get(name, ())):
            if candidate in self.splits:
                return self.splits[candidate]
        raise DataError(f"{self.location}: manifest has no {name!r} split; allowed: a prepared folder with "
                        f"{name}/ (it has: {', '.join(sorted(self.splits)) or 'none'})")

    def timm_info(self, name: str) -> dict:
        """timm's ``_info.json`` for these WebDataset shards: each split's files and shard lengths."""
        return {"name": name, "splits": {k: {"name": k, "num_samples": s.num_samples, "filenames": [f for f, _ in
                s.shards()], "shard_lengths": [n for _, n in s.shards()]} for k, s in self.splits.items()}}

    @classmethod
    def from_timm_info(cls, info: dict, location: str) -> "Manifest":
        """The manifest of a WebDataset folder that timm's ``_info.json`` describes (the module says what it lacks)."""
        try:
            splits = {}
            for key, s in info["splits"].items():
                files, lengths = list(s["filenames"]), [int(n) for n in s["shard_lengths"]]
                if len(files) != len(lengths):
                    raise ValueError(f"split {key!r}: {len(files)} filenames, {len(lengths)} shard_lengths")
                splits[key] = Split(sum(lengths), {}, {f: {"samples": n} for f, n in zip(files, lengths)})
        except (KeyError, TypeError, ValueError, AttributeError) as e:
            what = f"no {e}" if isinstance(e, KeyError) else str(e)
            raise DataError(f"{location}: {TIMM_INFO} does not list each split's filenames and shard_lengths "
                            f"({what}); allowed: timm's layout, or `convit-scale prep wds` output") from e
        return cls("wds", f"{location} ({TIMM_INFO})", {}, [], splits, location)

    def require_subset(self, fraction: float) -> None:
        """WebDataset subsets (Table 2) are made at conversion: the shards must hold the recipe's fraction."""
        if not math.isclose(self.subset_fraction, fraction):
            raise DataError(f"{self.location}: shards hold subset_fraction={self.subset_fraction}, the recipe asks "
                            f"{fraction}; convert with `convit-scale prep wds --subset-fraction {fraction}` "
                            f"(WebDataset subsets are made at conversion)")

    def to_dict(self) -> dict:
        return {"format": self.format, "source": self.source, "options": self.options, "classes": self.classes,
                "splits": {k: s.to_dict() for k, s in self.splits.items()}}

    @classmethod
    def from_dict(cls, d: dict, location: str = "") -> "Manifest":
        try:
            fmt = d["format"]
            if fmt not in FORMATS:
                raise ValueError(f"format {fmt!r}; allowed: {' or '.join(FORMATS)}")
            return cls(fmt, str(d.get("source", "")), dict(d.get("options", {})), list(d["classes"]),
                       {k: Split.from_dict(v) for k, v in d.get("splits", {}).items()}, location)
        except (KeyError, TypeError, ValueError, AttributeError) as e:
            what = f"no {e}" if isinstance(e, KeyError) else str(e)
            raise DataError(f"{location}: {MANIFEST} is not a prep manifest ({what}); convert with "
                            f"`convit-scale prep`") from e

    @classmethod
    def read(cls, location: str | Path) -> "Manifest":
        """The manifest of a local folder or a WebDataset URL template (or timm's ``_info.json`` of a local folder
        without one); a DataError in one line when there is none or it does not read."""
        location = str(location)
        if "{name}" not in location and not (Path(location) / MANIFEST).is_file() \
                and (Path(location) / TIMM_INFO).is_file():
            return cls.from_timm_info(_read_json(location, TIMM_INFO), location)
        return cls.from_dict(_read_json(location, MANIFEST), location)

    def write(self, folder: str | Path) -> Path:
        """Atomically, as the last file of a conversion: a folder with a manifest is complete."""
        path = Path(folder) / MANIFEST
        write_json_atomic(path, self.to_dict())
        return path


def described(location: str) -> bool:
    """A local folder with a manifest, or with timm's ``_info.json`` (a URL template cannot be listed: it is taken as
    described)."""
    return "{name}" in location or any((Path(location) / n).is_file() for n in (MANIFEST, TIMM_INFO))


def _read_json(location: str, name: str) -> dict:
    try:
        if "{name}" in location:
            from webdataset.gopen import gopen  # only a URL location needs it

            with gopen(location.format(name=name), "rb") as f:
                text = f.read()
        else:
            path = Path(location) / name
            if not path.is_file():
                raise DataError(f"{location}: no {name} (not found); convert with `convit-scale prep`, or, for "
                                f"WebDataset shards another tool wrote, give the folder timm's {TIMM_INFO}")
            text = path.read_bytes()
        return json.loads(text)
    except (OSError, ValueError) as e:
        raise DataError(f"{location}: no readable {name} ({e}); convert with `convit-scale prep`") from e
