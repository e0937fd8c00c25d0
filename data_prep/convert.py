"""ImageNet-style tree -> WebDataset tar shards or FFCV .beton files, with a manifest.

Two phases per split, both parallel across processes and both resumable:
1. check every image (decode it; convert CMYK/grey/PNG to RGB; list what cannot be read; for FFCV, decide how
   each image is stored), cached in ``.check-<split>.json`` so an interrupted run does not decode again;
2. write outputs to a temporary name and rename when complete, so no half-written file ever looks
   finished; finished outputs recorded in ``.state-<split>.json`` are not redone.
``manifest.json`` (written last, atomically) records the source, options, class map, samples per class
and per output file, every skipped file with its reason, and a sha256 per output file.
"""

from __future__ import annotations

import hashlib
import io
import json
import math
import os
import random
import tarfile
import time
from concurrent.futures import ProcessPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
from PIL import Image, UnidentifiedImageError
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

from convit_scale.ffcv_threads import importing_ffcv
from convit_scale.files import atomic_path, write_json_atomic
from convit_scale.imagetree import PrepError, Sample, list_classes, load_rgb_jpeg, scan_split, subsample
from convit_scale.jpeg import decode_rgb_array
from convit_scale.manifest import MANIFEST, TIMM_INFO, DataError, Manifest, Split


@dataclass
class PrepOptions:
    fmt: str = "wds"
    """'wds' (tar shards of the original JPEG bytes) or 'ffcv' (.beton)."""
    splits: tuple[str, ...] = ("train", "val")
    subset_fraction: float = 1.0
    """Table 2: keep the first floor(n_c * f) train files per class (sorted)."""
    shard_size: int = 1000
    """wds: samples per shard (shards differ by at most one sample)."""
    seed: int = 0
    """wds: the shuffle before sharding (ImageFolder order is by class)."""
    num_classes: int | None = None
    """Keep only the first N classes (sorted folder names), train and val: the appendix's 100-class experiments (the
    official code's ``--nb_classes``); None keeps every class."""
    write_mode: str = "keep"
    """ffcv: 'keep' stores each source JPEG's own bytes where the loader's decoder gives PIL's pixels from them (every
    ImageNet JPEG but the CMYK ones), the other images (CMYK, PNG named .JPEG, a JPEG turbojpeg warns about) as PIL's
    RGB pixels, raw; 'jpg', 'raw', 'proportion', 'smart' are ffcv's own modes, every image decoded and written by
    ffcv ('jpg': every image re-encoded at ``jpeg_quality``, the earlier default, with a 384-pixel max side)."""
    max_resolution: int | None = None
    """ffcv: shrink images whose longer side exceeds this (ffcv's INTER_AREA resize); with 'keep' those images are
    re-encoded at ``jpeg_quality``, the others kept. None keeps every image at its size, as timm's loaders see it."""
    jpeg_quality: int = 90
    """ffcv: the quality of the JPEGs prep encodes ('jpg', 'proportion', 'smart', and with 'keep' the resized
    images); kept JPEGs keep their own."""
    strict: bool = False
    """Fail instead of skipping unreadable files."""
    workers: int = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    val_labels: str | None = None
    val_synsets: str | None = None


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def _check_one(sample: tuple[str, int, int | None]) -> tuple[str, int, str | None, str | None]:
    path, label, _ = sample
    _, reason, _ = load_rgb_jpeg(path)
    return path, label, reason, None


KEPT, RAW, RESIZED = "kept", "raw", "resized"
"""How ``write_mode: keep`` stores an image: its own JPEG bytes, PIL's RGB pixels, or shrunk and re-encoded."""


def _check_one_ffcv(sample: tuple[str, int, int | None]) -> tuple[str, int, str | None, str | None]:
    """``write_mode: keep``: read the image as timm's loaders do (PIL, then RGB) and decide how to store it: KEPT when
    it is a JPEG the FFCV loader's decoder turns into exactly those pixels, RESIZED when its longer side is above
    ``max_resolution``, RAW otherwise (CMYK, PNG named .JPEG, a JPEG turbojpeg refuses or warns about)."""

    path, label, max_resolution = sample
    data = Path(path).read_bytes()
    if not data:
        return path, label, "empty file", None
    try:
        with Image.open(io.BytesIO(data)) as img:
            img.load()  # a truncated JPEG raises here
            if max_resolution is not None and max(img.size) > max_resolution:
                return path, label, None, RESIZED
            pixels = np.asarray(img.convert("RGB"))
            is_jpeg = img.format == "JPEG" and img.mode in ("RGB", "L")
    except (UnidentifiedImageError, OSError, SyntaxError, ValueError) as e:
        return path, label, f"undecodable: {type(e).__name__}: {e}", None
    ours = decode_rgb_array(data, *pixels.shape[:2]) if is_jpeg else None
    return path, label, None, KEPT if ours is not None and np.array_equal(ours, pixels) else RAW


def _progress():
    return Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                    TextColumn("{task.fields[rate]:>8} img/s"), TimeRemainingColumn(), transient=False)


def _check_images(samples: list[Sample], out: Path, split: str, opts: PrepOptions,
                  key: str) -> tuple[list[Sample], list[dict], dict[str, str]]:
    """(readable samples, skipped ones with the reason, {path: storage} for ``write_mode: keep``)."""
    cache = out / f".check-{split}.json"
    if cache.is_file():
        cached = json.loads(cache.read_text())
        if cached.get("key") == key:
            return [Sample(p, label) for p, label, _ in cached["valid"]], cached["skipped"], {
                p: how for p, _, how in cached["valid"] if how is not None}
    keep = opts.fmt == "ffcv" and opts.write_mode == "keep"
    valid, skipped, storage = [], [], {}
    t0 = time.time()
    with _progress() as progress, ProcessPoolExecutor(opts.workers) as pool:
        task = progress.add_task(f"check {split}", total=len(samples), rate="")
        results = pool.map(_check_one_ffcv if keep else _check_one,
                           [(s.path, s.label, opts.max_resolution) for s in samples], chunksize=64)
        for i, (path, label, reason, how) in enumerate(results, 1):
            if reason is None:
                valid.append(Sample(path, label))
                if how is not None:
                    storage[path] = how
            else:
                skipped.append({"path": path, "reason": reason})
            if i % 256 == 0 or i == len(samples):
                progress.update(task, completed=i, rate=f"{i / max(time.time() - t0, 1e-9):.0f}")
    write_json_atomic(cache, {"key": key, "valid": [[s.path, s.label, storage.get(s.path)] for s in valid],
                               "skipped": skipped})
    return valid, skipped, storage


# -- WebDataset -----------------------------------------------------------------------------------
def _write_shard(job: tuple[str, list[tuple[int, str, int]]]) -> tuple[str, str, int]:
    """Write one tar shard (tmp name, then rename). Members: <key>.jpg, <key>.cls."""
    final, items = job
    with atomic_path(final) as tmp, tarfile.open(tmp, "w", format=tarfile.USTAR_FORMAT) as tar:
        for key, path, label in items:
            data, reason, _ = load_rgb_jpeg(path)
            if data is None:  # changed since the check phase
                raise PrepError(f"{path}: {reason} (the file changed during conversion)")
            for ext, payload in (("jpg", data), ("cls", str(label).encode())):
                info = tarfile.TarInfo(f"{key:09d}.{ext}")
                info.size, info.mtime, info.mode = len(payload), 0, 0o444
                tar.addfile(info, io.BytesIO(payload))
    return final, sha256_file(Path(final)), len(items)


def shard_plan(n: int, shard_size: int) -> list[int]:
    """Shard sizes for n samples: ceil(n / shard_size) shards differing by at most one sample."""
    n_shards = max(1, math.ceil(n / shard_size))
    base, extra = divmod(n, n_shards)
    return [base + (i < extra) for i in range(n_shards)]


def _write_wds(samples: list[Sample], out: Path, split: str, opts: PrepOptions, key: str) -> dict[str, dict]:
    order = list(range(len(samples)))
    random.Random(opts.seed).shuffle(order)  # ImageFolder order is by class: shuffle before sharding
    sizes = shard_plan(len(samples), opts.shard_size)
    stem = f"{split}-f{opts.subset_fraction:g}-s{opts.shard_size}"
    jobs, start = [], 0
    for i, size in enumerate(sizes):
        items = [(j, samples[j].path, samples[j].label) for j in order[start:start + size]]
        jobs.append((str(out / f"{stem}-{i:06d}.tar"), items))
        start += size
    state_file = out / f".state-{split}.json"
    state = json.loads(state_file.read_text()) if state_file.is_file() else {}
    done = state.get("done", {}) if state.get("key") == key else {}
    files = {}
    todo = []
    for final, items in jobs:
        name = Path(final).name
        if name in done and Path(final).is_file():  # finished before an interruption
            files[name] = {"samples": len(items), "sha256": done[name],
                           "per_class": _per_class([label for _, _, label in items])}
        else:
            todo.append((final, items))
    per_class_of = {Path(f).name: _per_class([label for _, _, label in items]) for f, items in jobs}
    t0 = time.time()
    with _progress() as progress, ProcessPoolExecutor(opts.workers) as pool:
        total = sum(len(items) for _, items in jobs)
        task = progress.add_task(f"wds {split}", total=total, completed=total - sum(len(i) for _, i in todo), rate="")
        written = 0
        for final, sha, count in pool.map(_write_shard, todo):
            name = Path(final).name
            files[name] = {"samples": count, "sha256": sha, "per_class": per_class_of[name]}
            done[name] = sha
            write_json_atomic(state_file, {"key": key, "done": done})
            written += count
            progress.update(task, advance=count, rate=f"{written / max(time.time() - t0, 1e-9):.0f}")
    return dict(sorted(files.items()))


def _per_class(labels: list[int]) -> dict[str, int]:
    counts: dict[str, int] = {}
    for label in labels:
        counts[str(label)] = counts.get(str(label), 0) + 1
    return dict(sorted(counts.items(), key=lambda kv: int(kv[0])))


# -- FFCV -------------------------------------------------------------------------------------------
class _RGBDataset:
    """Map-style (PIL RGB image, label) over checked samples, for ffcv's own write modes."""

    def __init__(self, samples: list[Sample]):
        self.samples = samples

    def __len__(self) -> int:
        return len(self.samples)

    def __getitem__(self, i: int):
        data, reason, _ = load_rgb_jpeg(self.samples[i].path)
        if data is None:
            raise PrepError(f"{self.samples[i].path}: {reason} (the file changed during conversion)")
        return Image.open(io.BytesIO(data)).convert("RGB"), self.samples[i].label


class _KeptDataset:
    """Map-style ((ffcv mode, height, width, bytes), label) for ``write_mode: keep``, by the check's decision."""

    def __init__(self, samples: list[Sample], storage: dict[str, str], opts: PrepOptions):
        self.samples, self.storage, self.opts = samples, storage, opts

    def __len__(self) -> int:
        return len(self.samples)

    def __getitem__(self, i: int):
        path, label = self.samples[i].path, self.samples[i].label
        data = Path(path).read_bytes()
        how = self.storage[path]
        try:
            with Image.open(io.BytesIO(data)) as img:
                if how == KEPT:
                    return ("jpg", img.size[1], img.size[0], np.frombuffer(data, dtype=np.uint8)), label
                pixels = np.asarray(img.convert("RGB"))
        except (OSError, SyntaxError, ValueError) as e:
            raise PrepError(f"{path}: undecodable: {type(e).__name__}: {e} (the file changed during conversion)") from e
        if how == RAW:
            return ("raw", *pixels.shape[:2], np.ascontiguousarray(pixels).reshape(-1)), label

        with importing_ffcv():
            from ffcv.fields.rgb_image import encode_jpeg, resizer

        pixels = resizer(pixels, self.opts.max_resolution)
        return ("jpg", *pixels.shape[:2], encode_jpeg(pixels, self.opts.jpeg_quality)), label


def _encode_prepared(destination, image, malloc) -> None:
    """The image field's ``encode`` for ``write_mode: keep``: the bytes ``_KeptDataset`` prepared, as they are."""

    with importing_ffcv():
        from ffcv.fields.rgb_image import IMAGE_MODES

    mode, height, width, payload = image
    destination["mode"] = IMAGE_MODES[mode]
    destination["height"], destination["width"] = height, width
    destination["data_ptr"], storage = malloc(payload.nbytes)
    storage[:] = payload


def _image_field(opts: PrepOptions):
    """ffcv's RGBImageField; for ``keep``, one whose ``encode`` stores ``_KeptDataset``'s bytes. ffcv records a
    field's type by its exact class (``TYPE_ID_HANDLER``), so the field stays an RGBImageField, read back by any
    ffcv, and only this instance's encode is replaced (a module function: it reaches the writer's processes)."""

    with importing_ffcv():
        from ffcv.fields import RGBImageField

    if opts.write_mode != "keep":
        return RGBImageField(write_mode=opts.write_mode, max_resolution=opts.max_resolution,
                             jpeg_quality=opts.jpeg_quality)
    field = RGBImageField(write_mode="jpg")
    field.encode = _encode_prepared
    return field


def beton_name(split: str, opts: PrepOptions) -> str:
    """The .beton's name, by its parameters (ffcv-imagenet's train_256_0.5_90.ffcv)."""
    side = opts.max_resolution or "full"
    return f"{split}_{side}_{opts.write_mode}_q{opts.jpeg_quality}_f{opts.subset_fraction:g}.beton"


def _write_ffcv(samples: list[Sample], out: Path, split: str, opts: PrepOptions, key: str,
                storage: dict[str, str]) -> dict[str, dict]:
    with importing_ffcv():
        from ffcv.fields import IntField
        from ffcv.writer import DatasetWriter

    name = beton_name(split, opts)
    final = out / name
    state_file = out / f".state-{split}.json"
    state = json.loads(state_file.read_text()) if state_file.is_file() else {}
    per_class = _per_class([s.label for s in samples])
    if state.get("key") == key and name in state.get("done", {}) and final.is_file():
        return {name: {"samples": len(samples), "sha256": state["done"][name], "per_class": per_class}}
    print(f"ffcv {split}: writing {len(samples)} images to {final}")
    with atomic_path(final) as tmp:
        writer = DatasetWriter(str(tmp), {"image": _image_field(opts), "label": IntField()}, num_workers=opts.workers)
        writer.from_indexed_dataset(_KeptDataset(samples, storage, opts) if opts.write_mode == "keep"
                                    else _RGBDataset(samples))
    sha = sha256_file(final)
    write_json_atomic(state_file, {"key": key, "done": {name: sha}})
    return {name: {"samples": len(samples), "sha256": sha, "per_class": per_class}}


# -- entry point ------------------------------------------------------------------------------------
OWNER = ".prep.json"
"""Written into ``out`` before anything else: the folder is this command's output of that format, even before
``manifest.json`` exists (an interrupted conversion resumes into it)."""

WRITE_MODES = ("keep", "jpg", "raw", "proportion", "smart")


def check_options(opts: PrepOptions) -> None:
    """The options' ranges (the command line checks them too; library callers get the same one line)."""
    checks = [
        ("format", opts.fmt, opts.fmt in ("wds", "ffcv"), "wds or ffcv"),
        ("--subset-fraction", opts.subset_fraction, 0 < opts.subset_fraction <= 1, "in (0, 1]"),
        ("--jpeg-quality", opts.jpeg_quality, 1 <= opts.jpeg_quality <= 100, "in 1..100"),
        ("--shard-size", opts.shard_size, opts.shard_size >= 1, ">= 1"),
        ("--max-resolution", opts.max_resolution, opts.max_resolution is None or opts.max_resolution >= 1, ">= 1"),
        ("--num-classes", opts.num_classes, opts.num_classes is None or opts.num_classes >= 1, ">= 1"),
        ("--workers", opts.workers, opts.workers >= 1, ">= 1"),
        ("--write-mode", opts.write_mode, opts.write_mode in WRITE_MODES, "one of " + ", ".join(WRITE_MODES)),
    ]
    for name, value, ok, allowed in checks:
        if not ok:
            raise PrepError(f"prep {name} {value!r} is not allowed: must be {allowed}")


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
                largest = max(_per_class([s.label for s in samples]).values())
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
    valid, skipped, storage = _check_images(samples, out, split, opts, key)
    skipped = problems + skipped
    for s in skipped:
        print(f"skipped {s['path']}: {s['reason']}")
    if skipped and opts.strict:
        raise PrepError(f"{len(skipped)} unreadable or unlabelled input(s) in {src / split} under --strict; "
                        f"first: {skipped[0]['path']}: {skipped[0]['reason']}")
    if not valid:
        raise PrepError(f"no readable images in {src / split}")
    if opts.fmt == "wds":
        files = _write_wds(valid, out, split, opts, key)
    else:
        files = _write_ffcv(valid, out, split, opts, key, storage)
    for name, rec in files.items():  # sizes let a training run refuse a missing or truncated file cheaply
        rec["bytes"] = (out / name).stat().st_size
    entry = {"num_samples": len(valid), "per_class": _per_class([s.label for s in valid]), "files": files,
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


def verify(out: str | Path, src: str | Path | None = None) -> list[str]:
    """Re-read every output file of ``out`` and check it against the manifest; with ``src``, also check the
    manifest against that source tree (:func:`check_source`). Returns the problems found."""
    out = Path(out)
    if not (out / MANIFEST).is_file():
        return [f"no {MANIFEST} in {out}"]
    try:
        manifest = Manifest.read(out)
    except DataError as e:
        return [str(e)]
    problems = []
    n_classes = manifest.num_classes
    for split, info in manifest.splits.items():
        counts: dict[str, int] = {}
        for name, rec in info.files.items():
            path = out / name
            if not path.is_file():
                problems.append(f"{path}: missing")
                continue
            if sha256_file(path) != rec["sha256"]:
                problems.append(f"{path}: checksum differs from the manifest (corrupt or changed)")
            try:
                labels = _read_labels(path, manifest.format)
            except Exception as e:  # a truncated tar or beton is reported, not raised
                problems.append(f"{path}: unreadable ({type(e).__name__}: {e})")
                continue
            if len(labels) != rec["samples"]:
                problems.append(f"{path}: {len(labels)} samples, manifest says {rec['samples']}")
            if any(not 0 <= label < n_classes for label in labels):
                problems.append(f"{path}: labels outside 0..{n_classes - 1}")
            for k, v in _per_class(labels).items():
                counts[k] = counts.get(k, 0) + v
        if counts != info.per_class and not any(split in p for p in problems):
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


def _read_labels(path: Path, fmt: str) -> list[int]:
    if fmt == "ffcv":
        with importing_ffcv():
            from ffcv.reader import Reader

        return _ffcv_labels(Reader(str(path)))
    labels = []
    with tarfile.open(path, "r") as tar:
        for member in tar:
            if member.name.endswith(".cls"):
                labels.append(int(tar.extractfile(member).read()))
            elif member.name.endswith(".jpg"):
                tar.extractfile(member).read()  # read the bytes: a truncated member raises
    return labels


def _ffcv_labels(reader) -> list[int]:
    # IntField values live in the metadata table, one row per sample.
    return [int(v) for v in reader.metadata["f1"]]
