"""WebDataset tar shards of the checked images: each sample ``KEY.jpg`` (the source JPEG's own bytes, or PIL's RGB
re-encoded for CMYK, grey and PNG inputs) and ``KEY.cls``, shuffled before sharding, each shard written under a
temporary name and renamed when complete; finished shards recorded in ``.state-<split>.json`` are not redone."""

from __future__ import annotations

import io
import json
import math
import random
import tarfile
import time
from pathlib import Path

from convit_scale.files import atomic_path, write_json_atomic
from convit_scale.imagetree import PrepError, Sample

from .checks import class_counts, progress_bar, sha256_file, worker_pool
from .options import PrepOptions
from .sources import load_rgb_jpeg


def write_shard(job: tuple[str, list[tuple[int, str, int]]]) -> tuple[str, str, int]:
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


def write_wds(samples: list[Sample], out: Path, split: str, opts: PrepOptions, key: str,
              shuffle: bool = True) -> dict[str, dict]:
    """The split's shards; ``shuffle=False`` keeps the source's order (``sources.ORDERED``)."""
    order = list(range(len(samples)))
    if shuffle:
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
                           "per_class": class_counts([label for _, _, label in items])}
        else:
            todo.append((final, items))
    per_class_of = {Path(f).name: class_counts([label for _, _, label in items]) for f, items in jobs}
    t0 = time.time()
    with progress_bar() as progress, worker_pool(opts.workers) as pool:
        total = sum(len(items) for _, items in jobs)
        task = progress.add_task(f"wds {split}", total=total, completed=total - sum(len(i) for _, i in todo), rate="")
        written = 0
        for final, sha, count in pool.map(write_shard, todo):
            name = Path(final).name
            files[name] = {"samples": count, "sha256": sha, "per_class": per_class_of[name]}
            done[name] = sha
            write_json_atomic(state_file, {"key": key, "done": done})
            written += count
            progress.update(task, advance=count, rate=f"{written / max(time.time() - t0, 1e-9):.0f}")
    return dict(sorted(files.items()))
