"""Checkpoints: written under a temporary name and published by an atomic rename.

Layout: ``<output_dir>/checkpoints/step_000001234/`` holding the strategy's sharded state (DCP for
DDP/FSDP2, DeepSpeed's own for ZeRO), ``rng_rank<R>.pt`` per rank and ``meta.json`` (step, epoch,
position in the epoch, world size, strategy, model, global batch, config). A directory is complete only
once renamed from ``.tmp``; ``latest`` is the newest complete one, chosen by rank 0 and broadcast (ranks on
a network file system with attribute caching can disagree), so a crash mid-save never leaves a
half-written checkpoint that resume would pick.
"""

from __future__ import annotations

import json
import os
import random
import shutil
from pathlib import Path

import numpy as np
import torch

from .. import comm

PREFIX = "step_"


class CheckpointIncompatible(ValueError):
    """A checkpoint written by another strategy, model or global batch than the recipe's."""


def rng_state() -> dict:
    return {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}


def set_rng_state(state: dict) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])


def complete_checkpoints(root: Path) -> list[Path]:
    if not root.is_dir():
        return []
    found = [p for p in root.iterdir() if p.is_dir() and p.name.startswith(PREFIX) and p.name[len(PREFIX):].isdigit()
             and (p / "meta.json").is_file()]
    return sorted(found, key=lambda p: int(p.name[len(PREFIX):]))


def latest_checkpoint(root: Path) -> Path | None:
    found = complete_checkpoints(root)
    return found[-1] if found else None


def choose_checkpoint(root: Path, resume: str) -> Path | None:
    """The checkpoint to resume from (``checkpoint.resume``: auto, none or a path), decided on rank 0 and
    broadcast so that every rank loads the same one. Rank 0 also removes ``.tmp`` folders that crashed saves
    left behind."""
    choice = None
    if comm.rank() == 0:
        if root.is_dir():
            _recover_interrupted_swaps(root)
            for stale in [*root.glob(f"{PREFIX}*.tmp"), *root.glob(f"{PREFIX}*.old")]:
                shutil.rmtree(stale, ignore_errors=True)
        choice = latest_checkpoint(root) if resume == "auto" else (None if resume == "none" else Path(resume))
        choice = None if choice is None else str(choice)
    choice = comm.broadcast_object(choice)
    return None if choice is None else Path(choice)


def _recover_interrupted_swaps(root: Path) -> None:
    """A crash between the two renames of a same-step save (``step_N`` -> ``.old``, ``.tmp`` -> ``step_N``) leaves no
    ``step_N``: publish the complete new one (fsynced, with meta.json) or else put the old one back."""
    for side in [*root.glob(f"{PREFIX}*.tmp"), *root.glob(f"{PREFIX}*.old")]:  # a complete new one first
        final = side.with_suffix("")
        if not final.exists() and (side / "meta.json").is_file():
            os.replace(side, final)


def check_compatible(path: Path, meta: dict, expected: dict) -> None:
    """Refuse a checkpoint whose strategy, model or global batch differs from the recipe's, naming both."""
    for key, what in (("strategy", "parallel.strategy"), ("model", "model.name"),
                      ("global_batch_size", "data.global_batch_size")):
        saved = meta.get(key, meta.get("config", {}).get("data", {}).get(key) if key == "global_batch_size" else None)
        if saved is not None and key in expected and saved != expected[key]:
            raise CheckpointIncompatible(
                f"checkpoint {path} was written with {what} = {saved!r}, the recipe has {expected[key]!r}: resume with "
                f"the same {what}, or start a new run (another run.output_dir, or checkpoint.resume=none)")
    world = expected.get("world_size")
    if world is not None and str(meta.get("strategy", "")).startswith("zero") and meta.get("world_size") != world:
        raise CheckpointIncompatible(
            f"checkpoint {path} holds DeepSpeed ZeRO state partitioned over {meta.get('world_size')} ranks, the run has "
            f"{world}: DeepSpeed does not repartition it; resume on {meta.get('world_size')} ranks (or use fsdp2, "
            f"whose checkpoints reshard)")


def _fsync_tree(path: Path) -> None:
    """Flush every file under ``path`` and the folders themselves, so that the rename publishes data on disk."""
    for dirpath, _, files in os.walk(path):
        for name in files:
            fd = os.open(os.path.join(dirpath, name), os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        _fsync_dir(Path(dirpath))


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def save_checkpoint(root: Path, strategy, meta: dict, keep_last: int) -> Path:
    """Every rank calls this; rank 0 publishes and prunes."""
    rank = comm.rank()
    final = root / f"{PREFIX}{meta['step']:09d}"
    tmp = root / (final.name + ".tmp")
    if rank == 0:
        root.mkdir(parents=True, exist_ok=True)
        if tmp.exists():  # left by a crash during an earlier save
            shutil.rmtree(tmp)
        tmp.mkdir()
    comm.barrier()
    strategy.save(tmp)
    torch.save(rng_state(), tmp / f"rng_rank{rank}.pt")
    comm.barrier()
    if rank == 0:
        (tmp / "meta.json").write_text(json.dumps(meta, indent=1))
        _fsync_tree(tmp)
        if final.exists():  # the same step saved again (a stop signal right after a periodic save): the old
            old = root / (final.name + ".old")  # one stays complete until the new one is in place
            shutil.rmtree(old, ignore_errors=True)
            os.replace(final, old)
            os.replace(tmp, final)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.replace(tmp, final)  # the publication: atomic on a POSIX file system
        _fsync_dir(root)
        for stale in complete_checkpoints(root)[:-keep_last]:
            shutil.rmtree(stale, ignore_errors=True)
    comm.barrier()
    return final


def load_checkpoint(path: Path, strategy) -> dict:
    meta = json.loads((path / "meta.json").read_text())
    strategy.load(path)
    rng_file = path / f"rng_rank{comm.rank()}.pt"
    if rng_file.is_file() and meta.get("world_size") == comm.world_size():
        set_rng_state(torch.load(rng_file, weights_only=False))  # our own file: numpy's state is a tuple
    return meta


def read_meta(path: Path) -> dict:
    """A checkpoint's ``meta.json`` (FileNotFoundError naming the folder when it is not a complete checkpoint)."""
    if not (path / "meta.json").is_file():
        raise FileNotFoundError(f"checkpoint.resume: {path} is not a complete checkpoint (no meta.json)")
    return json.loads((path / "meta.json").read_text())
