"""`bench memory`: peak memory per rank of each strategy against the ideal, real training runs on CPU."""

from __future__ import annotations

import shutil
from pathlib import Path

from data_prep.fashion_mnist import build_tree

from ..config import ParallelConfig, load_config, recipe_path
from ..metrics import read_records
from ..models import create_model
from ..parallel.zero_config import zero_sizes
from ..runfolder import checkpoints
from ..train.launch import run_recipe
from .worker import RSS_ENV


def zero_overrides(strategy: str, params: int) -> list[str]:
    """The ZeRO sizes this benchmark measures, stated explicitly: the CPU ones (buffers of a tenth of the
    model, no overlap, every parameter sharded), whatever the defaults of the machine become."""

    if not strategy.startswith("zero"):
        return []
    z = zero_sizes(ParallelConfig(strategy=strategy), params, "cpu")
    out = [f"parallel.zero_bucket_elements={z['bucket']}",
           f"parallel.zero_overlap_comm={str(z['overlap_comm']).lower()}"]
    if strategy == "zero3":
        out += [f"parallel.zero_param_persistence_threshold={z['param_persistence_threshold']}",
                f"parallel.zero_prefetch_bucket_elements={z['prefetch_bucket']}",
                f"parallel.zero_max_live_parameters={z['max_live_parameters']}",
                f"parallel.zero_max_reuse_distance={z['max_reuse_distance']}"]
    return out


def training_run(tree: Path, out: Path, model: str, img_size: int, world: int, strategy: str, params: int,
                 steps: int, *extra: str):
    """The CPU demo recipe with ``model`` at ``img_size`` on ``tree``, 2 images per rank, ``steps`` steps under
    ``strategy`` (with the CPU ZeRO sizes) on ``world`` ranks, writing to ``out``: the validated config."""

    overrides = [f"model.name={model}", f"model.img_size={img_size}", "model.num_classes=10",
                 "data.format=imagefolder", f"data.train_path={tree}", "data.val_path=",
                 f"data.global_batch_size={2 * world}", "data.num_workers=0", "data.repeated_aug=1",
                 f"parallel.strategy={'none' if world == 1 and strategy == 'ddp' else strategy}",
                 "parallel.precision=fp32", f"schedule.max_steps={steps}", "log.every_steps=1", "log.progress=false",
                 "checkpoint.resume=none", f"run.output_dir={out}", *zero_overrides(strategy, params), *extra]
    return load_config(recipe_path("cpu/demo.yaml"), overrides)


def _measure(tree: Path, out: Path, model: str, img_size: int, world: int, strategy: str, params: int) -> dict:
    """One strategy on ``world`` processes: two training steps, memory from the run's metrics."""

    cfg = training_run(tree, out, model, img_size, world, strategy, params, 2, "log.debug_memory=true")
    rc = run_recipe(cfg, world, env=RSS_ENV, quiet=world == 1)
    recs = read_records(out) if rc == 0 else []
    shutil.rmtree(checkpoints(out), ignore_errors=True)  # 2 GB per configuration, not needed
    train = [r for r in recs if r["kind"] == "train"]
    if not train:
        return {"strategy": strategy, "world": world, "error": f"exit {rc}"}
    last = train[-1]
    peak = max(last["peak_mem_mb"]) - last["base_mem_mb"]  # during the training steps
    setup = last["setup_peak_mem_mb"] - last["base_mem_mb"]  # building and sharding (rank 0)
    state = max(last["state_mem_mb"])  # live tensors after backward: the model state
    ideal = 16 * params / world / 2**20
    return {"strategy": strategy, "world": world, "state_mb": state, "state_vs_ideal": state / ideal,
            "peak_mb": peak, "vs_ideal": peak / ideal, "setup_peak_mb": setup, "ideal_state_mb": ideal}


def bench_memory(work: Path, model: str, img_size: int, worlds: list[int], strategies: list[str]) -> dict:
    """Per strategy and world size, per rank: the model state (memory of live tensors after backward, once
    the optimizer moments exist), the peak RSS during a few real training steps and the peak of set-up,
    both above the process baseline before the model exists."""

    tree = build_tree(work / "tree", {"train": 20, "val": 4})
    params = sum(p.numel() for p in create_model(model, device="meta").parameters())
    rows = [_measure(tree, work / f"{s}_{world}", model, img_size, world, s, params)
            for world in worlds for s in strategies]
    return {"model": model, "params": params, "img_size": img_size, "rows": rows}
