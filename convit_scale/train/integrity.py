"""Checkpoints trusted only once checked, and saves that fail in one line.

Listing: when a checkpoint is published, its ``meta.json`` lists every file of it with its size and checksum
(``runfolder.CHECKSUM``), computed after the files are written and before the publication (:func:`gather_listing`, each
rank checking its share of the files, or :func:`listing` on one thread, as an asynchronous writer's publication
would). Verification: a resume checks the newest checkpoint against its listing, every rank reading its share of the
files and the answers all-gathered; a damaged or incomplete one (a missing file, another size, another checksum,
an unreadable meta.json) is set aside as ``step_<N>.damaged`` with a record in ``faults.jsonl`` and a log line, and
the next older is checked, down to the newest intact one. A checkpoint without a listing (an older release) is
trusted as it is.

Storage: a save estimates what it needs (the previous checkpoint's size, else the state's) and is refused before
it starts when the file system has less free; a save the file system refuses (ENOSPC, EDQUOT, EROFS, EACCES,
EPERM) ends every rank with :class:`StorageError`, one line naming the path, the bytes needed and free and the last
good checkpoint, and leaves nothing half-published.
"""

from __future__ import annotations

import errno
import json
import os
import shutil
import time
from pathlib import Path

from .. import comm
from ..errors import BadInput
from ..files import write_atomic
from ..runfolder import (
    DAMAGED,
    FAULTS,
    LATEST,
    META,
    check_listing,
    complete_checkpoints,
    list_files,
    read_listing,
    tree_files,
)

STORAGE_ERRNOS = {errno.ENOSPC: "no space left", errno.EDQUOT: "disk quota exceeded",
                  errno.EROFS: "read-only file system", errno.EACCES: "permission denied",
                  errno.EPERM: "operation not permitted"}


class CheckpointDamaged(BadInput, ValueError):
    """No intact checkpoint to resume from, or a named checkpoint that does not match its listing."""


class StorageError(RuntimeError):
    """A save that did not fit or that the file system refused: one line (the module says what it names)."""


# -- listing and verification ---------------------------------------------------------------------------------------
def listing(folder: Path, rank: int = 0, world: int = 1) -> dict[str, dict]:
    """This rank's share (every ``world``-th file from ``rank``) of the files of a written checkpoint folder, with
    sizes and checksums; ``rank=0, world=1``: all of them. No collective: an asynchronous publisher calls it too."""
    return list_files(folder, tree_files(folder, skip=(META,))[rank::world])


def gather_listing(share: dict[str, dict], group=None) -> dict[str, dict]:
    """Every rank calls this once all ranks have listed their share of the folder (``listing(folder, rank,
    world_size)``): the listing of the whole folder (``group``: the group of the collective, as
    :func:`comm.all_gather_object` takes it)."""
    out: dict[str, dict] = {}
    for part in comm.all_gather_object(share, group):
        out.update(part)
    return dict(sorted(out.items()))


def verify_checkpoint(path: Path) -> list[str]:
    """Every rank calls this: what is wrong with ``path`` (empty when intact), each rank checking its share of the
    listed files; every rank gets the same answer."""
    files, problems = read_listing(path) if comm.rank() == 0 else (None, [])
    files, problems = comm.broadcast_object((files, problems))
    if problems or files is None:
        return problems
    names = sorted(files)[comm.rank()::comm.world_size()]
    found = comm.all_gather_object(check_listing(path, files, names))
    return [p for part in found for p in part]


def newest_intact(root: Path, log=print) -> Path | None:
    """Every rank calls this: the newest checkpoint of ``root`` that matches its listing (None if there is none).
    The damaged ones newer than it are set aside by rank 0, each with a ``faults.jsonl`` record and a log line;
    when checkpoints were found and none is intact, :class:`CheckpointDamaged` in one line."""
    names = comm.broadcast_object([p.name for p in complete_checkpoints(root)][::-1] if comm.rank() == 0 else None)
    damaged = []
    for name in names:
        problems = verify_checkpoint(root / name)
        if not problems:
            break
        damaged.append((name, problems))
    else:
        name = None
    if comm.rank() == 0:
        for bad, problems in damaged:
            _set_aside(root, bad, problems, name, log)
        if damaged and name is not None:
            write_atomic(root / LATEST, name + "\n")
    if damaged and name is None:
        raise CheckpointDamaged(
            f"no intact checkpoint in {root}: {'; '.join(f'{n}: {p[0]}' for n, p in damaged[:3])} (set aside as "
            f"<name>{DAMAGED}); allowed: restore a checkpoint, or start the run afresh in another run.output_dir")
    return None if name is None else root / name


def _set_aside(root: Path, name: str, problems: list[str], instead: str | None, log) -> None:
    """Rank 0: ``step_<N>`` -> ``step_<N>.damaged`` (kept for the operator), a fault record, a log line."""
    aside = root / (name + DAMAGED)
    n = 1
    while aside.exists():
        aside, n = root / f"{name}{DAMAGED}.{n}", n + 1
    os.replace(root / name, aside)
    rec = {"kind": "checkpoint_damaged", "checkpoint": str(root / name), "set_aside": str(aside),
           "problems": problems[:20], "resumed_from": instead, "time": time.time(),
           "job": os.environ.get("SLURM_JOB_ID", ""), "restart": int(os.environ.get("SLURM_RESTART_COUNT", "0") or 0)}
    with open(root.parent / FAULTS, "a") as f:
        f.write(json.dumps(rec) + "\n")
    more = f" (and {len(problems) - 2} more)" if len(problems) > 2 else ""
    log(f"checkpoint {root / name} is damaged: {'; '.join(problems[:2])}{more}; set aside as {aside.name}, "
        f"{'resuming from ' + instead if instead else 'no older checkpoint to resume from'}")


# -- storage --------------------------------------------------------------------------------------------------------
def human(n: int | float) -> str:
    for unit in ("bytes", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "bytes" else f"{n:.1f} {unit}"
        n /= 1024
    return str(n)


def free_bytes(folder: Path) -> int:
    """Free bytes (for this user) on the file system of ``folder`` or its first existing parent."""
    existing = next(p for p in (folder, *folder.parents) if p.exists())
    return shutil.disk_usage(existing).free


def folder_bytes(folder: Path) -> int:
    files, _ = read_listing(folder)
    if files is not None:
        return sum(int(r["bytes"]) for r in files.values())
    return sum(p.stat().st_size for p in folder.rglob("*") if p.is_file())


def state_bytes(strategy) -> int:
    """Every rank calls this: about what a save of the strategy's state writes (its tensors; a DDP replica once)."""
    local = sum(t.numel() * t.element_size() for t in strategy.optimizer_tensors())
    sizes = comm.all_gather_object(local)
    return max(sizes) if strategy.name in ("ddp", "none") else sum(sizes)


def storage_phrase(e: BaseException) -> str | None:
    """``"<what> (<path>)"`` when ``e`` (or an error inside it: DCP gathers the ranks' errors) is a storage failure,
    else None."""
    seen, todo = set(), [e]
    while todo:
        x = todo.pop()
        if x is None or id(x) in seen:
            continue
        seen.add(id(x))
        if isinstance(x, OSError) and x.errno in STORAGE_ERRNOS:
            where = f" ({x.filename})" if x.filename else ""
            return f"{STORAGE_ERRNOS[x.errno]}{where}"
        todo += [x.__cause__, x.__context__, getattr(x, "exc", None)]
        failures = getattr(x, "failures", None)
        if isinstance(failures, dict):  # DCP: rank -> (exception, traceback)
            todo += [v for f in failures.values() for v in (f if isinstance(f, tuple) else (f,))
                     if isinstance(v, BaseException)]
    return None


def storage_message(root: Path, step: int, what: str, need: int, free: int) -> str:
    newest = complete_checkpoints(root)
    last = f"{newest[-1]} (intact)" if newest else "none"
    return (f"checkpoint at step {step} into {root}: {what}; the save needs about {human(need)} ({need} bytes), "
            f"{human(free)} ({free} bytes) free there; the last good checkpoint is {last}; allowed: free space or "
            f"raise the quota, or move run.output_dir to a writable file system with room, then resume")


def check_room(root: Path, strategy, step: int) -> int:
    """Every rank calls this before a save: the bytes it needs (the previous checkpoint's size, else the state's),
    refused on every rank with :class:`StorageError` when the file system has less free."""
    previous = complete_checkpoints(root) if comm.rank() == 0 else []
    need = folder_bytes(previous[-1]) if previous else None
    if comm.broadcast_object(need is None):
        need = state_bytes(strategy)
    need = comm.broadcast_object(need)
    refusal = None
    if comm.rank() == 0:
        free = free_bytes(root)
        if free < need:
            refusal = storage_message(root, step, "refused before it started: it would not fit", need, free)
    refusal = comm.broadcast_object(refusal)
    if refusal:
        raise StorageError(refusal)
    return need


def raise_storage(what: str | None, root: Path, tmp: Path, need: int, step: int) -> None:
    """Every rank calls this after a part of a save: when ``what`` (the same on every rank) names a storage failure,
    rank 0 removes the unpublished folder and every rank raises :class:`StorageError`."""
    if what is None:
        return
    if comm.rank() == 0:
        shutil.rmtree(tmp, ignore_errors=True)
    try:
        free = free_bytes(root)
    except OSError:
        free = 0
    raise StorageError(storage_message(root, step, f"the save failed: {what}", need, free))
