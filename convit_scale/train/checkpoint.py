"""Checkpoints: written under a temporary name and published by an atomic rename.

Layout: ``<output_dir>/checkpoints/step_000001234/`` holding the strategy's sharded state (DCP for
DDP/FSDP2, DeepSpeed's own for ZeRO), ``rng_rank<R>.pt`` per rank and ``meta.json`` (step, epoch,
position in the epoch, world size, config). A directory is complete only once renamed from
``.tmp``; ``latest`` is the newest complete one, so a crash mid-save never leaves a half-written
checkpoint that resume would pick.
"""

from __future__ import annotations

import json
import os
import random
import shutil
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

PREFIX = "step_"


def rng_state() -> dict:
    return {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}


def set_rng_state(state: dict) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])


def complete_checkpoints(root: Path) -> list[Path]:
    if not root.is_dir():
        return []
    found = [p for p in root.iterdir() if p.is_dir() and p.name.startswith(PREFIX) and not p.name.endswith(".tmp")
             and (p / "meta.json").is_file()]
    return sorted(found, key=lambda p: int(p.name[len(PREFIX):]))


def latest_checkpoint(root: Path) -> Path | None:
    found = complete_checkpoints(root)
    return found[-1] if found else None


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def save_checkpoint(root: Path, strategy, meta: dict, keep_last: int) -> Path:
    """Every rank calls this; rank 0 publishes and prunes."""
    rank = dist.get_rank()
    final = root / f"{PREFIX}{meta['step']:09d}"
    tmp = root / (final.name + ".tmp")
    if rank == 0:
        root.mkdir(parents=True, exist_ok=True)
        if tmp.exists():  # left by a crash during an earlier save
            shutil.rmtree(tmp)
        tmp.mkdir()
    dist.barrier()
    strategy.save(tmp)
    torch.save(rng_state(), tmp / f"rng_rank{rank}.pt")
    dist.barrier()
    if rank == 0:
        (tmp / "meta.json").write_text(json.dumps(meta, indent=1))
        if final.exists():  # the same step saved again (e.g. a stop signal right after a periodic save)
            shutil.rmtree(final)
        os.replace(tmp, final)  # the publication: atomic on a POSIX file system
        _fsync_dir(root)
        for old in complete_checkpoints(root)[:-keep_last]:
            shutil.rmtree(old, ignore_errors=True)
    dist.barrier()
    return final


def load_checkpoint(path: Path, strategy) -> dict:
    meta = json.loads((path / "meta.json").read_text())
    strategy.load(path)
    rng_file = path / f"rng_rank{dist.get_rank()}.pt"
    if rng_file.is_file() and meta.get("world_size") == dist.get_world_size():
        set_rng_state(torch.load(rng_file, weights_only=False))  # our own file: numpy's state is a tuple
    return meta
