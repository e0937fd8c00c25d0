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
FORMATS = ("ffcv", "wds")
"""The formats ``convit-scale prep`` writes."""


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
        """The split ``name``, or a DataError naming the location and the splits it has."""
        if name not in self.splits:
            raise DataError(f"{self.location}: manifest has no {name!r} split; allowed: a prepared folder with "
                            f"{name}/ (it has: {', '.join(sorted(self.splits)) or 'none'})")
        return self.splits[name]

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
        """The manifest of a local folder or a WebDataset URL template; a DataError in one line when there is none
        or it does not read."""
        location = str(location)
        try:
            if "{name}" in location:
                from webdataset.gopen import gopen  # only a URL location needs it

                with gopen(location.format(name=MANIFEST), "rb") as f:
                    text = f.read()
            else:
                path = Path(location) / MANIFEST
                if not path.is_file():
                    raise DataError(f"{location}: no {MANIFEST} (not found); convert with `convit-scale prep`")
                text = path.read_bytes()
            d = json.loads(text)
        except (OSError, ValueError) as e:
            raise DataError(f"{location}: no readable {MANIFEST} ({e}); convert with `convit-scale prep`") from e
        return cls.from_dict(d, location)

    def write(self, folder: str | Path) -> Path:
        """Atomically, as the last file of a conversion: a folder with a manifest is complete."""
        path = Path(folder) / MANIFEST
        write_json_atomic(path, self.to_dict())
        return path


def is_prepared(location: str) -> bool:
    """A local folder with a manifest (a URL template cannot be listed: it is taken as prepared)."""
    return "{name}" in location or (Path(location) / MANIFEST).is_file()
