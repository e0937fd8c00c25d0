"""The run folder's protocol, shared by the ranks and the Slurm launcher's bookkeeping (``convit_scale.faults``, which
runs on the standard library alone): its layout, the exit statuses, the listing of a checkpoint's files, and the
run's lease. Standard library only: it imports nothing of the package.

A run folder (``run.output_dir``) holds::

    config.yaml                 the resolved recipe
    checkpoints/step_<N>/       a checkpoint (complete once meta.json is in; meta.json lists its files)
    checkpoints/latest          names the newest complete checkpoint
    checkpoints/best/           the best evaluation's weights
    checkpoints/step_<N>.damaged  a checkpoint resume found damaged, kept aside for the operator
    metrics.jsonl               the run's records
    faults.jsonl, faults_starts.jsonl   the launcher's fault records and starts (faults.py)
    heartbeat/rank_<r>.json     each rank's progress (train/watchdog.py)
    hangs/                      hang reports and stacks (train/watchdog.py)
    lease.json                  which process trains into the folder (below)
    STOPPED_FOR_REQUEUE         written by rank 0 after a planned stop's save

The lease: rank 0 of a training writes ``lease.json`` (host, pid, Slurm job and step, restart count, heartbeat
time) before any rank trains, renews its time from its watchdog thread, and removes it at the end. Another training
into the folder is refused while the lease is alive; a lease whose heartbeat is older than ``fault.hang_timeout_s``
(its holder lost its node) is taken over, at once by a requeue or restart of the same Slurm job, or when its holder
was a process of this host that is gone.
"""

from __future__ import annotations

import json
import os
import socket
import time
import zlib
from pathlib import Path

CHECKPOINTS = "checkpoints"
PREFIX = "step_"
"""A checkpoint's folder: ``step_<step, 9 digits>``."""
LATEST = "latest"
"""A text file in the checkpoints folder naming its newest complete checkpoint (for people and tools: resume finds
the newest by listing the folder)."""
BEST = "best"
"""The checkpoints folder's copy of the best evaluation so far: ``model.safetensors`` (the whole model, fp32, as
``convit-scale export`` writes it) and ``meta.json``; outside the steps that resume and pruning see."""
META = "meta.json"
"""A checkpoint's description, written last: the checkpoint is complete once it is in."""
DAMAGED = ".damaged"
"""The suffix a damaged checkpoint's folder gets when resume sets it aside."""
FAULTS = "faults.jsonl"
STARTS = "faults_starts.jsonl"
HEARTBEAT = "heartbeat"
HANGS = "hangs"
LEASE = "lease.json"
STOPPED_FOR_REQUEUE = "STOPPED_FOR_REQUEUE"
METRICS = "metrics.jsonl"

EXIT_BAD_INPUT = 2
"""Refused at start-up (data, checkpoint, world size, a folder another run holds) or data that failed during
training: one ``error:`` line. (Data that could not be reached during training, ``manifest.SourceUnavailable``, ends
a rank with 1 and its ``error:`` line instead: a crash to the launcher.)"""
EXIT_NONFINITE = 3
"""Stopped by the non-finite policy, without saving."""
EXIT_REQUEUE = 75
"""Saved after a stop signal: the launcher requeues the job (EX_TEMPFAIL)."""
EXIT_HANG = 76
"""A rank's watchdog ended it: no progress within its phase's timeout."""
EXIT_STORAGE = 77
"""A save that did not fit or could not be written (no space, a quota, a read-only or forbidden folder): one
``error:`` line; the earlier checkpoints are intact. The launcher restarts into it at most once."""


CHECKSUM = "crc32"
"""The checksum a listing records for each file (``zlib.crc32``: the standard library, read in 4 MiB blocks at the
disk's speed, with no package to install on the launcher's host Python). It finds a truncated, zeroed or partly
rewritten file, the damage a shared file system brings; it is no defence against someone forging a file."""
_BLOCK = 4 << 20


def file_checksum(path: Path) -> str:
    """The file's ``CHECKSUM``, as 8 hex digits."""
    crc = 0
    with open(path, "rb") as f:
        while block := f.read(_BLOCK):
            crc = zlib.crc32(block, crc)
    return f"{crc:08x}"


def tree_files(folder: Path, skip: tuple[str, ...] = ()) -> list[str]:
    """The files under ``folder`` as sorted relative paths (``/``-separated), but the names in ``skip``."""
    found = [p.relative_to(folder).as_posix() for p in folder.rglob("*") if p.is_file()]
    return sorted(f for f in found if f not in skip)


def list_files(folder: Path, names: list[str]) -> dict[str, dict]:
    """``{name: {"bytes": size, CHECKSUM: digest}}`` of the named files under ``folder``: what a listing records,
    computed after the files are written."""
    return {n: {"bytes": (folder / n).stat().st_size, CHECKSUM: file_checksum(folder / n)} for n in names}


def check_listing(folder: Path, listing: dict[str, dict], names: list[str] | None = None,
                  checksums: bool = True) -> list[str]:
    """What differs between the files under ``folder`` and their ``listing`` (of :func:`list_files`), for the
    ``names`` given (all listed files by default): one phrase per file, missing, of another size or another
    checksum; empty when they all match. ``checksums=False`` compares sizes only (no file is read)."""
    problems = []
    for name in listing if names is None else names:
        rec, path = listing[name], folder / name
        try:
            size = path.stat().st_size
        except OSError:
            problems.append(f"{name} is missing")
            continue
        if size != rec["bytes"]:
            problems.append(f"{name} has {size} bytes, {rec['bytes']} listed (truncated or changed)")
        elif checksums and CHECKSUM in rec and (found := file_checksum(path)) != rec[CHECKSUM]:
            problems.append(f"{name} has {CHECKSUM} {found}, {rec[CHECKSUM]} listed (damaged)")
    return problems


def checkpoints(out: Path) -> Path:
    return Path(out) / CHECKPOINTS


def checkpoint_step(path: Path) -> int:
    """A checkpoint folder's step, -1 for a name that is not ``step_<N>``."""
    tail = Path(path).name[len(PREFIX):]
    return int(tail) if Path(path).name.startswith(PREFIX) and tail.isdigit() else -1


def complete_checkpoints(root: Path) -> list[Path]:
    """The complete ``step_<N>`` checkpoints of a checkpoints folder, oldest first."""
    if not root.is_dir():
        return []
    found = [p for p in root.iterdir() if p.is_dir() and checkpoint_step(p) >= 0 and (p / META).is_file()]
    return sorted(found, key=checkpoint_step)


def newest_checkpoint_step(out: Path) -> int:
    """The step of the run's newest complete checkpoint (one with meta.json), -1 for none."""
    found = complete_checkpoints(checkpoints(out))
    return checkpoint_step(found[-1]) if found else -1


def read_listing(path: Path) -> tuple[dict | None, list[str]]:
    """(the listing of a checkpoint's files in its meta.json, or None for a checkpoint of an older release, which
    has none; what is wrong with meta.json itself)."""
    try:
        meta = json.loads((Path(path) / META).read_text())
    except (OSError, ValueError) as e:
        return None, [f"{META} is unreadable ({type(e).__name__})"]
    files = meta.get("files") if isinstance(meta, dict) else None
    return (files if isinstance(files, dict) else None), []


def checkpoint_problems(path: Path, checksums: bool = True) -> list[str]:
    """What is wrong with a checkpoint folder against the listing in its meta.json, read on one process (``eval``,
    ``export``, ``analyze``; ``checksums=False``: sizes only, no file read, as the preflight checks); empty when
    it is intact."""
    files, problems = read_listing(path)
    return problems or ([] if files is None else check_listing(Path(path), files, checksums=checksums))


# -- the lease ------------------------------------------------------------------------------------------------------
def lease_identity() -> dict:
    """Who this process is, as its lease records it."""
    env = os.environ
    return {"host": socket.gethostname(), "pid": os.getpid(), "job": env.get("SLURM_JOB_ID", ""),
            "step": env.get("SLURM_STEP_ID", ""), "restart": int(env.get("SLURM_RESTART_COUNT", "0") or 0)}


def read_lease(out: Path) -> dict | None:
    try:
        return json.loads((Path(out) / LEASE).read_text())
    except (OSError, ValueError):
        return None


def describe_holder(lease: dict) -> str:
    job = f", Slurm job {lease['job']} step {lease.get('step') or '?'}" if lease.get("job") else ""
    return f"pid {lease.get('pid')} on {lease.get('host')}{job}"


def _process_gone(lease: dict, me: dict) -> bool:
    """The holder was a process of this host that no longer runs."""
    if lease.get("host") != me["host"] or not isinstance(lease.get("pid"), int):
        return False
    try:
        os.kill(lease["pid"], 0)
    except ProcessLookupError:
        return True
    except PermissionError:  # another user's live process
        return False
    try:  # a killed holder whose parent died too stays a zombie where nothing reaps orphans (a container's init)
        state = Path(f"/proc/{lease['pid']}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state in ("Z", "X")


def lease_verdict(out: Path, stale_s: float, now: float | None = None) -> tuple[str, dict | None, str]:
    """(``free``, ``ours``, ``take over`` or ``held``; the lease found; why), for this process starting a training
    into ``out``. ``stale_s``: a lease whose heartbeat is older is taken over."""
    lease, me, now = read_lease(out), lease_identity(), time.time() if now is None else now
    if lease is None:
        return "free", None, "no lease"
    if lease.get("host") == me["host"] and lease.get("pid") == me["pid"]:
        return "ours", lease, "this process holds it"
    age = now - float(lease.get("time", 0))
    if me["job"] and lease.get("job") == me["job"]:
        return "take over", lease, f"a restart of the same Slurm job {me['job']} (restart {me['restart']})"
    if age > stale_s:
        return "take over", lease, f"its heartbeat is {age:.0f} s old, beyond fault.hang_timeout_s = {stale_s:g} s"
    if _process_gone(lease, me):
        return "take over", lease, f"its process {lease.get('pid')} on this host is gone"
    return "held", lease, f"its heartbeat is {max(age, 0):.0f} s old"


class FolderHeld(ValueError):
    """Another training holds the run folder's lease (bad input: ``train.engine`` and ``cli`` report it as one line,
    as ``errors.BadInput``; this module imports nothing of the package, for the launcher's bookkeeping)."""


def check_lease(out: Path, stale_s: float) -> tuple[str, dict | None, str]:
    """:func:`lease_verdict`, refusing a lease that is alive in one line naming its holder."""
    verdict, lease, why = lease_verdict(out, stale_s)
    if verdict == "held":
        raise FolderHeld(
            f"run.output_dir {out} is in use by another training ({describe_holder(lease)}, {why}, lease "
            f"{Path(out) / LEASE}); allowed: another run.output_dir, or wait until it ends (its lease is taken over "
            f"once its heartbeat is older than fault.hang_timeout_s = {stale_s:g} s)")
    return verdict, lease, why


def write_lease(out: Path) -> dict:
    """Take the lease (rank 0, before training) or renew its heartbeat time (its watchdog)."""
    rec = {**lease_identity(), "time": time.time()}
    path = Path(out) / LEASE
    tmp = path.with_name(f".{LEASE}.{os.getpid()}.tmp")  # published whole, as files.write_atomic does
    tmp.write_text(json.dumps(rec) + "\n")
    os.replace(tmp, path)
    return rec


def renew_lease(out: Path) -> None:
    """Renew the heartbeat of a lease this process holds; a lease another process took over is left alone."""
    lease, me = read_lease(out), lease_identity()
    if lease is not None and (lease.get("host"), lease.get("pid")) == (me["host"], me["pid"]):
        write_lease(out)


def release_lease(out: Path) -> None:
    """Remove the lease if this process holds it."""
    lease, me = read_lease(out), lease_identity()
    if lease is not None and (lease.get("host"), lease.get("pid")) == (me["host"], me["pid"]):
        (Path(out) / LEASE).unlink(missing_ok=True)
