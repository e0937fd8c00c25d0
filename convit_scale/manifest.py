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
beside its manifest, so that timm's WebDataset reader takes its shards as they are (the val split named
``validation`` there, timm's default).

FFCV files another tool wrote (ffcv-imagenet's ``write_imagenet.py``: ``DatasetWriter`` with an ``RGBImageField``
and an ``IntField``) are read in place too: a ``.ffcv``/``.beton`` path, or a folder of them without
``manifest.json`` (``train*`` the train split, ``val*`` the val split; a lone file serves whichever split is asked
for). The samples per class and the number of labels are read from the file's label column
(``read_ffcv_labels``); class names are not recorded there, so none are given.

It sits below ``data/`` and ``data_prep/`` (both read it; a conversion's worker processes import no torch), with
:class:`DataError`, the one error of unusable data, which ``data/`` re-exports. It imports ffcv (through
``ffcv_threads``) only to read an FFCV file's label column.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from .errors import BadInput
from .ffcv_threads import importing_ffcv
from .files import write_json_atomic


class DataError(BadInput, RuntimeError):
    """Unusable data (missing files, a truncated shard, a manifest mismatch): one line naming the input."""


class SourceUnavailable(DataError):
    """Data that could not be reached during training (a shard that did not open after ``data.open_retries``: a
    remote store or a file system that is down): the data may be fine and come back, so a training rank ends with
    it as with a crash (exit status 1), which the launcher restarts where the run made progress, not as input it
    refuses (``EXIT_BAD_INPUT``), which would stop the job for good."""


MANIFEST = "manifest.json"
TIMM_INFO = "_info.json"
"""timm's description of a WebDataset folder (``timm.data.readers.reader_wds``)."""
FORMATS = ("ffcv", "wds")
"""The formats ``convit-scale prep`` writes."""
SPLIT_ALIASES = {"val": ("validation",)}
"""Other names of a split in other tools' layouts (timm's ImageNet shards name it ``validation``)."""
TIMM_SPLITS = {"val": "validation"}
"""timm's names of our splits, in the ``_info.json`` that ``prep wds`` writes (read back through ``SPLIT_ALIASES``;
the manifest keeps ``val``)."""


def split_in_name(name: str) -> str | None:
    """The split a file's name says: ``train`` or ``val`` (or another name of it, ``SPLIT_ALIASES``) as a word of it
    (``imagenet1k-validation-0001.tar``, ``train-00000-of-00257.parquet``, ``val_400_0.10_90.ffcv``); None when it
    says none, or both."""
    words = re.split(r"[-_.]", name.lower())
    found = [s for s in ("train", "val") if any(w in words for w in (s, *SPLIT_ALIASES.get(s, ())))]
    return found[0] if len(found) == 1 else None


FFCV_SUFFIXES = (".ffcv", ".beton")
"""FFCV files: ffcv-imagenet names them ``train_500_0.50_90.ffcv``, ``prep ffcv`` ``train_full_keep_q90_f1.beton``."""
FFCV_FIELDS = ("image", "label")
"""The image and label fields' names in FFCV files (``prep ffcv``'s and ffcv-imagenet's; ``data.ffcv_fields``)."""
FIELDS_OPTION = "data.ffcv_fields (`prep verify`: --ffcv-fields)"
"""Where other fields' names are given: the recipe's key, and ``prep verify``'s option (named in refusals)."""


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
    labels: np.ndarray | None = field(default=None, repr=False, compare=False)
    """An FFCV file read in place: the label of each sample, in file order (not written)."""

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
    num_labels: int | None = None
    """Data read in place without class names (FFCV files): the labels' count, from the label column."""
    lone: bool = False
    """One FFCV file read in place: its one split serves whichever split is asked for."""
    root: str = ""
    """Where the files are when not beside the manifest (``prep index --out`` for read-only or remote shards): a
    folder or a URL template with ``{name}``; written."""

    @property
    def shard_location(self) -> str:
        """The folder or URL template the files are read from."""
        return self.root or self.location

    @property
    def label_member(self) -> str:
        """WebDataset: the member a sample's label is read from: ``cls``, or ``json:FIELD`` (``prep index --label``)."""
        return str(self.options.get("label", "cls"))

    @property
    def num_classes(self) -> int:
        """The class names' count, else (data read in place) the labels': the label column's, or the largest label
        of the samples per class + 1 (``prep index``); 0 when nothing says."""
        seen = [int(k) for s in self.splits.values() for k in s.per_class]
        return len(self.classes) or self.num_labels or (max(seen) + 1 if seen else 0)

    @property
    def folder(self) -> Path:
        """The folder that the files' names are relative to (a lone FFCV file's own folder)."""
        path = Path(self.shard_location)
        return path.parent if path.suffix in FFCV_SUFFIXES and path.is_file() else path

    @property
    def subset_fraction(self) -> float:
        """The fraction of each class the conversion kept (Table 2 subsets made at conversion; 1.0: all)."""
        return float(self.options.get("subset_fraction", 1.0))

    def split(self, name: str) -> Split:
        """The split ``name`` (or its other name, ``SPLIT_ALIASES``), or a DataError naming the location and the
        splits it has."""
        if self.lone:
            return next(iter(self.splits.values()))
        for candidate in (name, *SPLIT_ALIASES.get(name, ())):
            if candidate in self.splits:
                return self.splits[candidate]
        raise DataError(f"{self.location}: manifest has no {name!r} split; allowed: a prepared folder with "
                        f"{name}/ (it has: {', '.join(sorted(self.splits)) or 'none'})")

    def timm_info(self, name: str) -> dict:
        """timm's ``_info.json`` for these WebDataset shards: each split's files and shard lengths, under timm's name
        for it (``TIMM_SPLITS``: ``val`` as ``validation``, what timm's ``train.py --val-split`` and
        ``create_dataset`` read by default)."""
        splits = {TIMM_SPLITS.get(k, k): s for k, s in self.splits.items()}
        return {"name": name, "splits": {k: {"name": k, "num_samples": s.num_samples, "filenames": [f for f, _ in
                s.shards()], "shard_lengths": [n for _, n in s.shards()]} for k, s in splits.items()}}

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

    @classmethod
    def from_ffcv_files(cls, location: str, files: list[Path], fields: tuple[str, str] = FFCV_FIELDS) -> "Manifest":
        """The manifest of FFCV files another tool wrote (the module says how files map to splits)."""
        by_split: dict[str, list[Path]] = {}
        for f in files:
            split = split_in_name(f.name) or f.stem
            by_split.setdefault(split, []).append(f)
        if len(files) > 1 and any(len(v) > 1 for v in by_split.values()):
            raise DataError(f"{location}: {len(files)} FFCV files ({', '.join(f.name for f in files)}), more than one "
                            f"for a split; allowed: one train* and one val* file, or name one file as the location")
        splits, top = {}, -1
        for split, (path,) in by_split.items():
            labels = read_ffcv_labels(path, fields)
            counts = np.bincount(labels) if len(labels) else np.zeros(0, dtype=np.int64)
            per_class = {str(c): int(n) for c, n in enumerate(counts) if n}
            splits[split] = Split(len(labels), per_class, {path.name: {"samples": len(labels)}}, labels=labels)
            top = max(top, len(counts) - 1)
        return cls("ffcv", f"{location} (FFCV files)", {}, [], splits, location, num_labels=top + 1,
                   lone=len(files) == 1)

    def require_whole(self, fraction: float) -> None:
        """FFCV subsets (Table 2) are taken at load time from a whole .beton: one converted with a subset already
        would give the product of the two fractions."""
        if fraction < 1.0 and self.subset_fraction < 1.0:
            raise DataError(f"{self.location}: the FFCV file holds a subset already (prep --subset-fraction "
                            f"{self.subset_fraction:g}); data.subset_fraction = {fraction:g} would keep "
                            f"{fraction * self.subset_fraction:g} of each class; allowed: a .beton of the whole train "
                            f"set (FFCV subsets are taken at load time), or data.subset_fraction = 1.0")

    def require_classes(self, num_classes: int | None) -> None:
        """WebDataset shards keep the first N classes only when converted so (``prep wds --num-classes N``); shards
        whose class count nothing records (timm's layout) are refused naming ``prep index``, which counts it."""
        if num_classes is not None and not self.num_classes:
            raise DataError(f"{self.location}: the shards' class count is unknown (no class names or per-class "
                            f"counts recorded, as timm's {TIMM_INFO} records none), "
                            f"data.num_classes = {num_classes}; describe them with `convit-scale prep index "
                            f"{self.shard_location} --out DIR` (it counts the classes; --label json:FIELD where the "
                            f"labels are in KEY.json) and train from DIR, or set data.num_classes = null")
        if num_classes is not None and self.num_classes != num_classes:
            raise DataError(f"{self.location}: shards hold {self.num_classes} classes, data.num_classes = "
                            f"{num_classes}; convert with `convit-scale prep wds --num-classes {num_classes}` "
                            f"(WebDataset keeps a class subset at conversion), or set data.num_classes = null")

    def require_subset(self, fraction: float) -> None:
        """WebDataset subsets (Table 2) are made at conversion: the shards must hold the recipe's fraction."""
        if not math.isclose(self.subset_fraction, fraction):
            raise DataError(f"{self.location}: shards hold subset_fraction={self.subset_fraction}, the recipe asks "
                            f"{fraction}; convert with `convit-scale prep wds --subset-fraction {fraction}` "
                            f"(WebDataset subsets are made at conversion)")

    def to_dict(self) -> dict:
        root = {"root": self.root} if self.root else {}
        return {"format": self.format, "source": self.source, "options": self.options, "classes": self.classes,
                "splits": {k: s.to_dict() for k, s in self.splits.items()}, **root}

    @classmethod
    def from_dict(cls, d: dict, location: str = "") -> "Manifest":
        try:
            fmt = d["format"]
            if fmt not in FORMATS:
                raise ValueError(f"format {fmt!r}; allowed: {' or '.join(FORMATS)}")
            return cls(fmt, str(d.get("source", "")), dict(d.get("options", {})), list(d["classes"]),
                       {k: Split.from_dict(v) for k, v in d.get("splits", {}).items()}, location,
                       root=str(d.get("root", "")))
        except (KeyError, TypeError, ValueError, AttributeError) as e:
            what = f"no {e}" if isinstance(e, KeyError) else str(e)
            raise DataError(f"{location}: {MANIFEST} is not a prep manifest ({what}); convert with "
                            f"`convit-scale prep`") from e

    @classmethod
    def read(cls, location: str | Path, ffcv_fields: tuple[str, str] = FFCV_FIELDS) -> "Manifest":
        """The manifest of a local folder or a WebDataset URL template (or timm's ``_info.json`` of a local folder
        without one, or FFCV files read in place: ``ffcv_fields`` names their image and label fields); a DataError
        in one line when there is none or it does not read."""
        location = str(location)
        files = ffcv_files(location)
        if files:
            return cls.from_ffcv_files(location, files, ffcv_fields)
        if "{name}" not in location and not (Path(location) / MANIFEST).is_file() \
                and (Path(location) / TIMM_INFO).is_file():
            return cls.from_timm_info(_read_json(location, TIMM_INFO), location)
        return cls.from_dict(_read_json(location, MANIFEST), location)

    def write(self, folder: str | Path) -> Path:
        """Atomically, as the last file of a conversion: a folder with a manifest is complete."""
        path = Path(folder) / MANIFEST
        write_json_atomic(path, self.to_dict())
        return path


def read_label(payload: bytes, member: str = "cls") -> int:
    """A WebDataset sample's label from its label member's bytes (``Manifest.label_member``): a ``.cls`` member's
    integer, or with ``json:FIELD`` that field of the ``.json`` member; ValueError, KeyError or TypeError when it is
    not an integer there."""
    _, _, field = member.partition(":")
    value = json.loads(payload)[field] if field else payload
    if isinstance(value, (bool, float)):
        raise TypeError(f"{value!r} is not an integer")
    return int(value)


def described(location: str) -> bool:
    """A local folder with a manifest, or with timm's ``_info.json``, or FFCV files (a URL template cannot be listed:
    it is taken as described)."""
    return ("{name}" in location or any((Path(location) / n).is_file() for n in (MANIFEST, TIMM_INFO))
            or bool(ffcv_files(location)))


def ffcv_files(location: str) -> list[Path]:
    """The FFCV files to read in place at ``location``: the file itself, or those of a folder without a manifest."""
    path = Path(location)
    if "{name}" in location:
        return []
    if path.is_file():
        return [path] if path.suffix in FFCV_SUFFIXES else []
    if not path.is_dir() or (path / MANIFEST).is_file():
        return []
    return sorted(f for f in path.iterdir() if f.suffix in FFCV_SUFFIXES and f.is_file())


def read_ffcv_labels(path: Path, fields: tuple[str, str] = FFCV_FIELDS) -> np.ndarray:
    """The label of each sample of an FFCV file (its label field's column of the metadata table); a DataError naming
    the file's fields when it lacks the image or label field."""
    with importing_ffcv():
        from ffcv.fields import IntField
        from ffcv.reader import Reader

    try:
        reader = Reader(str(path))
    except Exception as e:  # ffcv raises what numpy or its header check raises for a file it cannot read
        raise DataError(f"{path}: not a readable FFCV file ({type(e).__name__}: {e})") from e
    names = list(reader.field_names)
    image, label = fields
    if image not in names or label not in names:
        raise DataError(f"{path}: FFCV fields {names}, no {image!r} image field or no {label!r} label field; set "
                        f"{FIELDS_OPTION} to the file's [image, label] names")
    index = names.index(label)
    if not isinstance(reader.handlers[label], IntField):
        raise DataError(f"{path}: FFCV field {label!r} is a {type(reader.handlers[label]).__name__}, not an IntField; "
                        f"set {FIELDS_OPTION} to the file's [image, label] names")
    labels = np.asarray(reader.metadata[f"f{index}"]).astype(np.int64)
    if len(labels) and labels.min() < 0:
        raise DataError(f"{path}: negative labels in field {label!r}; allowed: labels 0..N-1")
    return labels


def _read_json(location: str, name: str) -> dict:
    try:
        if "{name}" in location:
            from webdataset.gopen import gopen  # only a URL location needs it

            with gopen(location.format(name=name), "rb") as f:
                text = f.read()
        else:
            path = Path(location) / name
            if not path.is_file() and any(Path(location).glob("*.tar")):
                raise DataError(f"{location}: WebDataset shards without {name} or timm's {TIMM_INFO}; describe them "
                                f"once with `convit-scale prep index {location}` (--out DIR where the folder is "
                                f"read-only)")
            if not path.is_file():
                raise DataError(f"{location}: no {name} (not found); convert with `convit-scale prep`, or, for "
                                f"WebDataset shards another tool wrote, give the folder timm's {TIMM_INFO}")
            text = path.read_bytes()
        return json.loads(text)
    except (OSError, ValueError) as e:
        raise DataError(f"{location}: no readable {name} ({e}); convert with `convit-scale prep`") from e
