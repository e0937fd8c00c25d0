"""`bench saves`: what checkpoints cost a run, the same tiny run not saving, saving at once every few steps and
saving beside training (``checkpoint.async_save``), per strategy, on this machine: the whole run's wall-clock and the
time each save held the step (the ``save_s`` of its metrics)."""

from __future__ import annotations

import shutil
import statistics
import time
from pathlib import Path

from data_prep.fashion_mnist import build_tree

from ..metrics import read_records
from ..models import create_model
from ..train.launch import run_recipe
from .memory import training_run

VARIANTS = (("no saves", None, False), ("saves at once", True, False), ("saves beside training", True, True))
"""(name, saves every ``every_steps``, beside training)."""


def _run(tree: Path, out: Path, model: str, img_size: int, world: int, strategy: str, params: int, steps: int,
         every: int | None, background: bool) -> dict:
    """One run of ``steps`` steps: its wall-clock (start-up included, the same for every variant) and its saves."""
    shutil.rmtree(out, ignore_errors=True)
    cfg = training_run(tree, out, model, img_size, world, strategy, params, steps, "checkpoint.every_epochs=100000",
                       f"checkpoint.every_steps={every or 'null'}", f"checkpoint.async_save={str(background).lower()}",
                       "log.every_steps=100000", "checkpoint.keep_last=2")
    t0 = time.perf_counter()
    rc = run_recipe(cfg, world, quiet=True, in_process=world == 1)
    wall = time.perf_counter() - t0
    recs = read_records(out, "checkpoint") if rc == 0 else []
    saves = [r["save_s"] for r in recs if r.get("reason") == "every_steps"]
    shutil.rmtree(out, ignore_errors=True)
    return {"rc": rc, "wall_s": wall, "saves": len(saves), "save_s": statistics.median(saves) if saves else None}


def bench_saves(work: Path, model: str, img_size: int, world: int, strategies: list[str], steps: int, every: int,
                rounds: int) -> dict:
    """Per strategy: the run without periodic saves, with a save every ``every`` steps at once, and beside
    training, in interleaved rounds (the best wall-clock of each kept); the wall-clock against the run without
    saves of the same strategy, and the median time a save held the step."""
    tree = build_tree(work / "tree", {"train": 20, "val": 4})
    params = sum(p.numel() for p in create_model(model, device="meta").parameters())
    cases = [(s, name, every if saves else None, background)
             for s in strategies for name, saves, background in VARIANTS]
    best: dict[tuple[str, str], dict] = {}
    for _ in range(rounds):
        for s, name, n, background in cases:
            r = _run(tree, work / f"saves_{s}", model, img_size, world, s, params, steps, n, background)
            if (s, name) not in best or (r["rc"] == 0 and r["wall_s"] < best[(s, name)]["wall_s"]):
                best[(s, name)] = r
    rows = []
    for s, name, _, _ in cases:
        r, base = best[(s, name)], best[(s, "no saves")]
        rows.append({"strategy": s, "variant": name, **r, "wall_vs_no_saves": r["wall_s"] / base["wall_s"]})
    return {"model": model, "img_size": img_size, "world": world, "steps": steps, "every_steps": every, "rows": rows}
