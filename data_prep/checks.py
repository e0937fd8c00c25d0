"""The first phase of a conversion: every image read once (in parallel processes), what cannot be read listed with
the reason, and for ``write_mode: keep`` how each image will be stored; cached per split in ``.check-<split>.json``
so that an interrupted conversion does not decode again."""

from __future__ import annotations

import contextlib
import hashlib
import io
import json
import multiprocessing
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import numpy as np
from PIL import Image, UnidentifiedImageError
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

from convit_scale.files import write_json_atomic
from convit_scale.imagetree import Sample, undecodable
from convit_scale.jpeg import decode_rgb_array

from .options import PrepOptions
from .sources import load_rgb_jpeg, read_bytes


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def class_counts(labels: list[int]) -> dict[str, int]:
    counts: dict[str, int] = {}
    for label in labels:
        counts[str(label)] = counts.get(str(label), 0) + 1
    return dict(sorted(counts.items(), key=lambda kv: int(kv[0])))


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
    data = read_bytes(path)
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
        return path, label, undecodable(e), None
    ours = decode_rgb_array(data, *pixels.shape[:2]) if is_jpeg else None
    return path, label, None, KEPT if ours is not None and np.array_equal(ours, pixels) else RAW


@contextlib.contextmanager
def worker_pool(workers: int):
    """A ``ProcessPoolExecutor`` of ``workers`` processes for the phases of a conversion. Left normally, it waits for
    them; left by an exception (a refused sample, Ctrl-C, a caller's time limit) its queued work is cancelled and its
    processes are killed, not waited for. ``ProcessPoolExecutor``'s own exit waits for every task already handed out:
    for ever when one worker hangs (a stalled read, a lock a forked worker inherited held).

    The workers come from a fork server, not from a fork of the caller: a caller with threads (torch's, numba's, a
    progress bar's) forked mid-operation hands its children locks held for ever and half-updated interpreter state (a
    crash in a child's first garbage collection was seen). The server imports this package once and forks from it."""
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(["data_prep.checks", "data_prep.index", "data_prep.wds_writer"])
    pool = ProcessPoolExecutor(workers, mp_context=ctx)
    try:
        yield pool
    except BaseException:
        processes = list((pool._processes or {}).values())  # shutdown() forgets them
        pool.shutdown(wait=False, cancel_futures=True)
        for p in processes:
            with contextlib.suppress(OSError, ValueError):
                p.kill()  # the pool's own thread reaps them and ends
        raise
    pool.shutdown(wait=True)


def progress_bar():
    return Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                    TextColumn("{task.fields[rate]:>8} img/s"), TimeRemainingColumn(), transient=False)


def check_images(samples: list[Sample], out: Path, split: str, opts: PrepOptions,
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
    with progress_bar() as progress, worker_pool(opts.workers) as pool:
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
