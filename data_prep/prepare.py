"""``prepare``: an ImageNet-style tree -> WebDataset tar shards or FFCV .beton files, with a manifest.

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
from dataclasses import asdict
from pathlib import Path

from convit_scale.files import write_json_atomic
from convit_scale.imagetree import PrepError, Sample, list_classes, scan_split, subsample
from convit_scale.manifest import MANIFEST, TIMM_INFO, Manifest, Split

from .checks import KEPT, RAW, RESIZED, check_images, class_counts
from .ffcv_writer import write_ffcv
from .options import PrepOptions, check_options
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


def _scan(src: Path, opts: PrepOptions, classes: list[str], all_classes: list[str]) -> dict:
    """Every split listed (no image read yet): {split: (samples, problems)}, before anything is written."""
    scanned = {}
    for split in opts.splits:
        if not (src / split).is_dir():
            if split == "train":
                raise PrepError(f"source has no train folder: {src / split}")
            continue
        samples, problems = scan_split(src, split, all_classes, Path(opts.val_labels) if opts.val_labels else None,
                                       Path(opts.val_synsets) if opts.val_synsets else None)
        samples, problems = _in_classes(samples, problems, classes, all_classes)
        if split == "train":
            kept = subsample(samples, opts.subset_fraction)
            if samples and not kept:
                largest = max(class_counts([s.label for s in samples]).values())
                raise PrepError(f"--subset-fraction {opts.subset_fraction:g} keeps no image of {src / split}: "
                                f"floor(n_c * f) = 0 for every class (the largest has {largest}); allowed: "
                                f"f >= {1 / largest:.3g}")
            samples = kept
        if not samples:
            raise PrepError(f"no images found in {src / split}")
        scanned[split] = samples, problems
    return scanned


def _convert_split(src: Path, out: Path, split: str, samples: list[Sample], problems: list[dict],
                   opts: PrepOptions) -> dict:
    """Check, then write one split; its manifest entry."""
    key = hashlib.sha256(json.dumps([asdict(opts), [(s.path, s.label) for s in samples]]).encode()).hexdigest()
    valid, skipped, storage = check_images(samples, out, split, opts, key)
    skipped = problems + skipped
    for s in skipped:
        print(f"skipped {s['path']}: {s['reason']}")
    if skipped and opts.strict:
        raise PrepError(f"{len(skipped)} unreadable or unlabelled input(s) in {src / split} under --strict; "
                        f"first: {skipped[0]['path']}: {skipped[0]['reason']}")
    if not valid:
        raise PrepError(f"no readable images in {src / split}")
    if opts.fmt == "wds":
        files = write_wds(valid, out, split, opts, key)
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
    """Convert ``src`` (ImageNet-style) into ``out``; returns the manifest."""
    src, out = Path(src), Path(out)
    if not src.is_dir():
        raise PrepError(f"source folder not found: {src}")
    check_options(opts)
    all_classes = list_classes(src / "train")
    classes = all_classes[:opts.num_classes] if opts.num_classes else all_classes
    if opts.num_classes and opts.num_classes > len(all_classes):
        raise PrepError(f"--num-classes {opts.num_classes}: {src / 'train'} has {len(all_classes)} classes; allowed: "
                        f"1..{len(all_classes)}")
    check_out(src, out, opts.fmt)
    scanned = _scan(src, opts, classes, all_classes)
    out.mkdir(parents=True, exist_ok=True)
    write_json_atomic(out / OWNER, {"format": opts.fmt, "source": str(src.resolve())})
    options = json.loads(json.dumps(asdict(opts)))  # as the file holds them (lists, not tuples)
    manifest = Manifest(opts.fmt, str(src.resolve()), options, classes, location=str(out))
    for split, (samples, problems) in scanned.items():
        manifest.splits[split] = Split.from_dict(_convert_split(src, out, split, samples, problems, opts))
    (out / "classes.txt").write_text("".join(f"{i}\t{c}\n" for i, c in enumerate(classes)))
    if opts.fmt == "wds":  # timm's WebDataset reader takes the shards as they are (--dataset wds/... --data-dir OUT)
        write_json_atomic(out / TIMM_INFO, manifest.timm_info(out.name))
    manifest.write(out)
    return manifest
