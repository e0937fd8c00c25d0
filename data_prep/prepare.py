"""``prepare``: an ImageNet-style tree, WebDataset shards or Parquet files (``sources.py``) -> WebDataset tar shards or
FFCV .beton files, with a manifest.

Two phases per split, both parallel across processes and both resumable:
1. check every image (``checks.py``: decode it; convert CMYK/grey/PNG to RGB; list what cannot be read; for FFCV,
   decide how each image is stored), cached in ``.check-<split>.json`` so an interrupted run does not decode again;
2. write outputs (``wds_writer.py``, ``ffcv_writer.py``) to a temporary name and rename when complete, so no
   half-written file ever looks finished; finished outputs recorded in ``.state-<split>.json`` are not redone.
``manifest.json`` (written last, atomically) records the source, options, class map, samples per class
and per output file, every skipped file with its reason, and a sha256 per output file. ``verify.py`` reads it back.
"""

from __future__ import annotations

import hashlib
import json
import math
from dataclasses import asdict
from pathlib import Path

from convit_scale.files import write_json_atomic
from convit_scale.imagetree import PrepError, Sample, list_classes, scan_split, subsample
from convit_scale.manifest import MANIFEST, TIMM_INFO, Manifest, Split

from .checks import KEPT, RAW, RESIZED, check_images, class_counts
from .ffcv_writer import write_ffcv
from .options import PrepOptions, check_options
from .sources import ORDERED, TREE, describe, list_source, source_kind
from .wds_writer import write_wds

OWNER = ".prep.json"
"""Written into ``out`` before anything else: the folder is this command's output of that format, even before
``manifest.json`` exists (an interrupted conversion resumes into it)."""


def output_format(out: Path) -> str | None:
    """The format of an earlier prep output in ``out`` (its manifest.json or marker), or None."""
    for name in (MANIFEST, OWNER):
        try:
            fmt = json.loads((out / name).read_text()).get("format")
        except (OSError, ValueError, AttributeError):
            continue
        if fmt:
            return fmt
    return None


def check_out(src: Path, out: Path, fmt: str) -> None:
    """Refuse an output folder where writing would damage something: inside the source tree, a file, a folder
    holding other files, or an earlier output of the other format. An earlier output of this format is
    allowed: the conversion resumes there."""
    s, o = src.resolve(), out.resolve()
    if o == s or s in o.parents:
        raise PrepError(f"prep --out {out} is inside --src {src}: shards would be written into the source tree; "
                        f"allowed: a folder outside --src")
    if o.exists() and not o.is_dir():
        raise PrepError(f"prep --out {out} is a file; allowed: a new or empty folder, or an earlier `prep {fmt}` "
                        f"output to resume")
    if not o.is_dir() or not any(o.iterdir()):
        return
    found = output_format(o)
    if found is None:
        raise PrepError(f"prep --out {out} is not empty and holds no prep output (no manifest.json): its files "
                        f"would be overwritten; allowed: a new or empty folder, or an earlier `prep {fmt}` output")
    if found != fmt:
        raise PrepError(f"prep --out {out} holds a `prep {found}` output; `prep {fmt}` would mix formats there; "
                        f"allowed: a new or empty folder, or an earlier `prep {fmt}` output")


def _in_classes(samples: list[Sample], problems: list[dict], classes: list[str],
                all_classes: list[str]) -> tuple[list[Sample], list[dict]]:
    """``--num-classes``: the samples of the first classes (their labels are the same in the full list), and the
    problems that are not about a class left out on purpose."""
    left_out = set(all_classes[len(classes):])
    return ([s for s in samples if s.label < len(classes)],
            [p for p in problems
             if Path(p["path"]).name not in left_out and Path(p["path"]).parent.name not in left_out])


def _listed(src: Path, kind: str, opts: PrepOptions, classes: list[str], all_classes: list[str],
            listed: dict) -> dict:
    """{split: (samples, problems)} as the source lists them, in the first ``len(classes)`` classes."""
    out = {}
    for split in opts.splits:
        if kind != TREE:
            if split in listed:
                out[split] = [s for s in listed[split] if s.label < len(classes)], []
            continue
        if (src / split).is_dir():
            samples, problems = scan_split(src, split, all_classes, Path(opts.val_labels) if opts.val_labels else None,
                                           Path(opts.val_synsets) if opts.val_synsets else None)
            out[split] = _in_classes(samples, problems, classes, all_classes)
    if "train" not in out:
        raise PrepError(f"source has no train split: {src / 'train'}" + ("" if kind == TREE else f" ({kind} files "
                        f"named train*, or a manifest's train split)"))
    return out


def _first_of_each_class(samples: list[Sample], fraction: float) -> list[Sample]:
    """Table 2 in a source's own order: the first floor(n_c * f) samples of each class, in place."""
    quota = {k: math.floor(int(v) * fraction) for k, v in class_counts([s.label for s in samples]).items()}
    kept = []
    for s in samples:
        if quota[str(s.label)] > 0:
            quota[str(s.label)] -= 1
            kept.append(s)
    return kept


def _scan(src: Path, kind: str, opts: PrepOptions, classes: list[str], all_classes: list[str],
          listed: dict | None = None) -> dict:
    """Every split listed (no image read yet): {split: (samples, problems)}, before anything is written."""
    scanned = {}
    for split, (samples, problems) in _listed(src, kind, opts, classes, all_classes, listed or {}).items():
        if split == "train":
            kept = (subsample if kind == TREE else _first_of_each_class)(samples, opts.subset_fraction)
            if samples and not kept:
                largest = max(class_counts([s.label for s in samples]).values())
                raise PrepError(f"--subset-fraction {opts.subset_fraction:g} keeps no image of {src / split}: "
                                f"floor(n_c * f) = 0 for every class (the largest has {largest}); allowed: "
                                f"f >= {1 / largest:.3g}")
            samples = kept
        if not samples:
            raise PrepError(f"no images found in {src / split}")
        if opts.fmt == "wds" and kind in ORDERED:
            _refuse_sorted(src, split, samples, opts.shard_size)
        scanned[split] = samples, problems
    return scanned


def _refuse_sorted(src: Path, split: str, samples: list[Sample], shard_size: int) -> None:
    """WebDataset shards keep a Parquet source's order: refused when it would make shards of one class."""
    run = longest = 1
    for a, b in zip(samples, samples[1:]):
        run = run + 1 if a.label == b.label else 1
        longest = max(longest, run)
    if longest > max(1, shard_size // 2):
        raise PrepError(f"{src}: its {split} rows are sorted by class ({longest} rows of one label in a row): "
                        f"WebDataset shards keep a Parquet source's order, so each would hold one or two classes; "
                        f"allowed: `convit-scale prep ffcv` (the epoch order is taken at load time), or a shuffled "
                        f"source")


def _convert_split(src: Path, out: Path, split: str, samples: list[Sample], problems: list[dict],
                   opts: PrepOptions, shuffle: bool = True) -> dict:
    """Check, then write one split; its manifest entry."""
    key = hashlib.sha256(json.dumps([asdict(opts), [(s.path, s.label) for s in samples]]).encode()).hexdigest()
    valid, skipped, storage = check_images(samples, out, split, opts, key)
    skipped = problems + skipped
    for s in skipped:
        print(f"skipped {describe(s['path'])}: {s['reason']}")
    if skipped and opts.strict:
        raise PrepError(f"{len(skipped)} unreadable or unlabelled input(s) in {src / split} under --strict; "
                        f"first: {skipped[0]['path']}: {skipped[0]['reason']}")
    if not valid:
        raise PrepError(f"no readable images in {src / split}")
    if opts.fmt == "wds":
        files = write_wds(valid, out, split, opts, key, shuffle)
    else:
        files = write_ffcv(valid, out, split, opts, key, storage)
    for name, rec in files.items():  # sizes let a training run refuse a missing or truncated file cheaply
        rec["bytes"] = (out / name).stat().st_size
    entry = {"num_samples": len(valid), "per_class": class_counts([s.label for s in valid]), "files": files,
             "skipped": skipped}
    if storage:  # write_mode keep: how many images kept their bytes, and which did not
        entry["images"] = {how: sum(1 for v in storage.values() if v == how) for how in (KEPT, RAW, RESIZED)}
        entry["stored_raw"] = sorted(p for p, how in storage.items() if how == RAW)  # ImageNet: its CMYK and PNG
    return entry


def prepare(src: str | Path, out: str | Path, opts: PrepOptions) -> Manifest:
    """Convert ``src`` (an ImageNet-style tree, WebDataset shards or Parquet files: ``sources.py``) into ``out``;
    returns the manifest."""
    src, out = Path(src), Path(out)
    if not src.is_dir():
        raise PrepError(f"source folder not found: {src}")
    check_options(opts)
    kind = source_kind(src)
    listed, named = {}, True
    if kind == TREE:
        all_classes = list_classes(src / "train")
    else:
        names, listed = list_source(src, kind, opts.splits, opts.image_column, opts.label_column)
        top = max((s.label for s in listed.get("train", [])), default=-1) + 1
        all_classes, named = names or [str(c) for c in range(top)], bool(names)  # unnamed: labels stand for themselves
    classes = all_classes[:opts.num_classes] if opts.num_classes else all_classes
    if opts.num_classes and opts.num_classes > len(all_classes):
        raise PrepError(f"--num-classes {opts.num_classes}: {src} has {len(all_classes)} classes; allowed: "
                        f"1..{len(all_classes)}")
    check_out(src, out, opts.fmt)
    scanned = _scan(src, kind, opts, classes, all_classes, listed)
    out.mkdir(parents=True, exist_ok=True)
    write_json_atomic(out / OWNER, {"format": opts.fmt, "source": str(src.resolve())})
    options = json.loads(json.dumps(asdict(opts)))  # as the file holds them (lists, not tuples)
    manifest = Manifest(opts.fmt, str(src.resolve()), options, classes, location=str(out))
    for split, (samples, problems) in scanned.items():
        manifest.splits[split] = Split.from_dict(_convert_split(src, out, split, samples, problems, opts,
                                                                shuffle=kind not in ORDERED))
    if not named:
        manifest.classes = []  # the source names no classes: none are made up (the labels' count is the per-class's)
    if named:
        (out / "classes.txt").write_text("".join(f"{i}\t{c}\n" for i, c in enumerate(classes)))
    if opts.fmt == "wds":  # timm's WebDataset reader takes the shards as they are (--dataset wds/... --data-dir OUT)
        write_json_atomic(out / TIMM_INFO, manifest.timm_info(out.name))
    manifest.write(out)
    return manifest
