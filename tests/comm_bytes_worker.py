"""The bytes each rank passes to collectives in a training step, for each strategy in turn (test_planner_comm.py).

Started once per world size under torch.distributed.run:

    python -m torch.distributed.run --nproc-per-node N tests/comm_bytes_worker.py RECIPE OUT

Every strategy of ``LAYOUTS`` is built in turn on the recipe's model, inside the one gloo process group, through the
strategy objects the engine uses (``build_strategy`` -> ``setup`` -> ``forward``/``backward`` per micro-batch -> the
optimizer step), run for ``STEPS`` steps and torn down. The collectives of the last step are counted at the
dispatcher (``c10d.allreduce_``, ``c10d._allgather_base_``, DTensor's functional collectives), below every Python
wrapper, so DDP's bucket all-reduces, which its C++ reducer issues, are counted as FSDP2's and DeepSpeed's are.
Each rank writes OUT/comm_rank<R>.json: {layout: {kind: {"bytes": B, "calls": C}}}; bytes are the full buffer of
the collective (an all-gather's output, a reduce-scatter's input, an all-reduce's tensor), as the planner's
``step_collectives`` counts them.
"""

from __future__ import annotations

import gc
import json
import os
import sys
from collections import defaultdict
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

# (layout name, parallel overrides); hsdp with 2 replicas (2 groups of world/2 shards)
LAYOUTS = [
    ("ddp", ["parallel.strategy=ddp"]),
    ("fsdp2", ["parallel.strategy=fsdp2"]),
    ("fsdp2-keep", ["parallel.strategy=fsdp2", "parallel.reshard_after_forward=false"]),
    ("hsdp", ["parallel.strategy=fsdp2", "parallel.hsdp_replicas=2"]),
    ("zero1", ["parallel.strategy=zero1"]),
    ("zero2", ["parallel.strategy=zero2"]),
    ("zero3", ["parallel.strategy=zero3"]),
]
MICRO, ACCUM, STEPS = 4, 2, 2  # ZeRO-3 records its module trace in step 1: step 2 is the steady state, counted

# c10d op -> (kind, index of the argument that holds the collective's full buffer)
FULL_BUFFER = {
    "allreduce_": ("all_reduce", 0), "allreduce_coalesced_": ("all_reduce", 0),
    "_allgather_base_": ("all_gather", 0), "allgather_": ("all_gather", 0),
    "allgather_into_tensor_coalesced_": ("all_gather", 0), "allgather_coalesced_": ("all_gather", 0),
    "_reduce_scatter_base_": ("reduce_scatter", 1), "reduce_scatter_": ("reduce_scatter", 1),
    "reduce_scatter_tensor_coalesced_": ("reduce_scatter", 1),
    "reduce_": ("reduce", 0), "broadcast_": ("broadcast", 0), "alltoall_base_": ("all_to_all", 1),
}
# functional collectives (DTensor's): (kind, index of the input, index of the group size or None)
FUNCTIONAL = {
    "all_reduce": ("all_reduce", 0, None), "all_reduce_": ("all_reduce", 0, None),
    "all_reduce_coalesced": ("all_reduce", 0, None),
    "all_gather_into_tensor": ("all_gather", 0, 1), "all_gather_into_tensor_coalesced": ("all_gather", 0, 1),
    "reduce_scatter_tensor": ("reduce_scatter", 0, None),
    "reduce_scatter_tensor_coalesced": ("reduce_scatter", 0, None),
    "broadcast": ("broadcast", 0, None), "all_to_all_single": ("all_to_all", 0, None),
}


def _nbytes(x) -> int:
    if isinstance(x, torch.Tensor):
        return x.numel() * x.element_size()
    if isinstance(x, (list, tuple)):
        return sum(_nbytes(t) for t in x)
    return 0


def collective_bytes(namespace: str, name: str, args) -> tuple[str, int] | None:
    """(kind, full-buffer bytes) of a collective op, None for any other op."""
    if namespace == "c10d" and name not in ("barrier", "monitored_barrier_"):
        kind, arg = FULL_BUFFER.get(name, (name, 0))
        return kind, _nbytes(args[arg])
    if namespace == "_c10d_functional" and name in FUNCTIONAL:
        kind, arg, group_size = FUNCTIONAL[name]
        return kind, _nbytes(args[arg]) * (args[group_size] if group_size is not None else 1)
    return None


class CountCollectives(TorchDispatchMode):
    """Bytes and calls per kind of collective, seen at the dispatcher (every c10d op passes there)."""

    def __init__(self):
        super().__init__()
        self.counts = defaultdict(lambda: {"bytes": 0, "calls": 0})

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        seen = collective_bytes(func.namespace, func.__name__.split(".")[0], args)
        if seen is not None:
            self.counts[seen[0]]["bytes"] += seen[1]
            self.counts[seen[0]]["calls"] += 1
        return func(*args, **(kwargs or {}))


def optimizer_step(strategy) -> None:
    """What follows the micro-batches, as the engine's step does it: this rank's share of the squared gradient norm
    reduced (the engine packs it with the step's other values in one all-reduce), then the update."""
    from convit_scale.train.step import StepStats

    stats = StepStats(torch.device("cpu"))  # the engine's one packed all-reduce, as it makes it
    stats.add("grad_sq", strategy.grad_square_sum())
    norm = stats.reduce().grad_sq ** 0.5
    strategy.step(norm if strategy.norm_is_global else None)


def train_step(strategy, num_classes: int, img_size: int) -> None:
    for m in range(ACCUM):
        x = torch.randn(MICRO, 3, img_size, img_size)
        y = torch.randint(0, num_classes, (MICRO,))
        last = m == ACCUM - 1
        with strategy.micro_batch(is_last_micro=last):
            loss = F.cross_entropy(strategy.forward(x).float(), y)
            strategy.backward(loss, is_last_micro=last, grad_accum=ACCUM)
    optimizer_step(strategy)


def run_layout(recipe: str, overrides: list[str], world: int) -> dict:
    from convit_scale.config import load_config, model_options
    from convit_scale.models import create_model
    from convit_scale.parallel import build_strategy
    from convit_scale.train.optim import build_optimizer

    cfg = load_config(recipe, overrides)
    torch.manual_seed(0)
    model = create_model(cfg.model.name, **model_options(cfg.model))
    strategy = build_strategy(model, cfg.parallel, torch.device("cpu"), world, cfg.optim.grad_clip)
    strategy.setup(lambda mod: build_optimizer(mod, cfg.optim, 1e-3, torch.device("cpu")), MICRO, ACCUM)
    strategy.train()
    for _ in range(STEPS - 1):
        train_step(strategy, cfg.model.num_classes, model.patch_embed.img_size[0])
    with CountCollectives() as counter:
        train_step(strategy, cfg.model.num_classes, model.patch_embed.img_size[0])
    strategy.close()
    del strategy, model
    gc.collect()
    dist.barrier()
    return dict(counter.counts)


def main(recipe: str, out: Path) -> None:
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    dist.init_process_group("gloo")
    world = dist.get_world_size()
    result = {name: run_layout(recipe, overrides, world) for name, overrides in LAYOUTS}
    (out / f"comm_rank{dist.get_rank()}.json").write_text(json.dumps(result))
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1], Path(sys.argv[2]))
