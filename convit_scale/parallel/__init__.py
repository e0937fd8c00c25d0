"""Training strategies behind one interface (``base.Strategy``): none (one process), DDP, FSDP2, DeepSpeed ZeRO-1/2/3.

The rooms: ``base`` (the interface and the step's norm helpers), ``single`` (none), ``ddp``, ``fsdp2`` and ``dcp``
(their checkpoints), ``zero`` (the ZeRO strategy), ``zero_config`` (its DeepSpeed config and buffer sizes, read by
the planner and ``bench memory`` too), ``zero_engine`` (the device, patches and bad-step gate it adds to DeepSpeed's
engine), ``universal`` (a ZeRO checkpoint resumed on another world size).

Adding a strategy touches these files, and only these:
1. ``config.py``: ``ParallelConfig.strategy`` (its Literal) and ``validate`` (the keys it needs or refuses);
2. ``parallel/<name>.py``: the ``Strategy`` subclass (``setup``, ``backward``, ``grad_square_sum``, ``step``,
   ``save``/``load`` at any world size, ``full_state_dict``), and this file's ``build_strategy`` and ``preload``;
3. ``train/distributed.py``: ``check_world``, the world sizes or precisions it refuses before any rank starts;
4. ``train/checkpoint.py``: ``RESUMABLE`` and ``check_compatible``, what a resume may change under it;
5. ``trained.py``: ``consolidate``, its checkpoint folder read without a process group (eval, export);
6. ``planner.py``: its memory per rank (``state_bytes``), its step's collectives and its layouts;
and the lists of names: ``bench/memory.py``'s and ``cli/bench.py``'s strategies, ``cli/experiment.py``'s choices,
``rehearsal/run.py``'s checkpoint file names; the tests: ``tests/test_parallel_nonfinite.py``'s bad step,
``tests/test_gpu.py``'s runs under NCCL.
"""

from .base import Strategy
from .ddp import DDPStrategy
from .fsdp2 import FSDP2Strategy
from .single import SingleProcessStrategy
from .zero import ZeroStrategy

STRATEGIES = {"none": SingleProcessStrategy, "ddp": DDPStrategy, "fsdp2": FSDP2Strategy, "zero1": ZeroStrategy,
              "zero2": ZeroStrategy, "zero3": ZeroStrategy}
"""``parallel.strategy`` -> the class that trains it."""


def build_strategy(model, p, device, world_size, grad_clip=None) -> Strategy:
    return STRATEGIES[p.strategy](model, p, device, world_size, grad_clip)


def preload(strategy: str) -> None:
    """Import what the strategy's set-up imports, so that a memory baseline taken before the model
    (`base_mem_mb`) holds the libraries' code and the peaks above it hold model state and buffers only.
    DeepSpeed's engine pulls in torch._dynamo: about 150 MB of RSS per process on CPU."""
    if strategy.startswith("zero"):
        import deepspeed.runtime.engine  # noqa: F401
        import torch._dynamo  # noqa: F401
    elif strategy == "fsdp2":
        from torch.distributed.fsdp import fully_shard  # noqa: F401


__all__ = ["STRATEGIES", "Strategy", "build_strategy", "preload"]
