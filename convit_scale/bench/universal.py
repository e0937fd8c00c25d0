"""`bench universal`: what an elastic resume of a ZeRO run costs once, rank 0 converting the checkpoint into DeepSpeed's
universal checkpoint while the other ranks wait (``parallel.universal.conversion_wait_s`` is how long they wait)."""

from __future__ import annotations

import shutil
import time
from pathlib import Path

from data_prep.fashion_mnist import build_tree

from ..errors import BadInput
from ..models import create_model
from ..parallel.universal import UNIVERSAL, conversion_files, conversion_wait_s, folder_bytes, universal_checkpoint
from ..runfolder import checkpoints
from ..train.checkpoint import latest_checkpoint
from ..train.launch import run_recipe
from .memory import training_run


def _convert(tree: Path, out: Path, model: str, img_size: int, world: int, strategy: str, params: int,
             tensors: int, timeout_s: float) -> dict:
    """A one-step run of ``strategy`` on ``world`` ranks, its checkpoint converted here (one worker, as rank 0 does)."""
    shutil.rmtree(out, ignore_errors=True)
    rc = run_recipe(training_run(tree, out, model, img_size, world, strategy, params, 1), world, quiet=True,
                    in_process=world == 1)
    ckpt = latest_checkpoint(checkpoints(out)) if rc == 0 else None
    if ckpt is None:
        return {"strategy": strategy, "world": world, "error": f"exit {rc}, no checkpoint"}
    t0 = time.perf_counter()
    universal_checkpoint(ckpt)
    seconds = time.perf_counter() - t0
    size = folder_bytes(ckpt / "zero")
    row = {"strategy": strategy, "world": world, "zero_bytes": size, "universal_bytes": folder_bytes(ckpt / UNIVERSAL),
           "universal_files": sum(1 for f in (ckpt / UNIVERSAL).rglob("*") if f.is_file()),
           "files_bound": conversion_files(tensors, world), "seconds": seconds, "mb_per_s": size / seconds / 1e6,
           "others_wait_up_to_s": conversion_wait_s(ckpt, timeout_s, tensors, world)}
    shutil.rmtree(checkpoints(out), ignore_errors=True)  # gigabytes for a large model
    return row


def bench_universal(work: Path, model: str, img_size: int, worlds: list[int], strategies: list[str],
                    timeout_s: float = 600.0) -> dict:
    """Per ZeRO stage and world size: the checkpoint's size, the conversion's time and rate, and how long the other
    ranks would wait for it (``conversion_wait_s`` with the default ``parallel.timeout_s``)."""
    bad = [s for s in strategies if not s.startswith("zero")]
    if bad:
        raise BadInput(f"--strategies {','.join(bad)}: allowed: zero1, zero2, zero3 (only ZeRO checkpoints are "
                       f"converted)")
    tree = build_tree(work / "tree", {"train": 20, "val": 4})
    meta = list(create_model(model, device="meta").parameters())
    params, tensors = sum(p.numel() for p in meta), len(meta)
    rows = [_convert(tree, work / f"{s}_{world}", model, img_size, world, s, params, tensors, timeout_s)
            for world in worlds for s in strategies]
    return {"model": model, "params": params, "img_size": img_size, "rows": rows}
