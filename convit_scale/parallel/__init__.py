"""Training strategies behind one interface: DDP, FSDP2, DeepSpeed ZeRO-1/2/3."""

from .base import Strategy
from .ddp import DDPStrategy
from .fsdp2 import FSDP2Strategy
from .zero import ZeroStrategy


def build_strategy(model, p, device, world_size, grad_clip=None) -> Strategy:
    if p.strategy in ("none", "ddp"):
        return DDPStrategy(model, p, device, world_size, grad_clip)
    if p.strategy == "fsdp2":
        return FSDP2Strategy(model, p, device, world_size, grad_clip)
    return ZeroStrategy(model, p, device, world_size, grad_clip)


def preload(strategy: str) -> None:
    """Import what the strategy's set-up imports, so that a memory baseline taken before the model
    (`base_mem_mb`) holds the libraries' code and the peaks above it hold model state and buffers only.
    DeepSpeed's engine pulls in torch._dynamo: about 150 MB of RSS per process on CPU."""
    if strategy.startswith("zero"):
        import deepspeed.runtime.engine  # noqa: F401
        import torch._dynamo  # noqa: F401
    elif strategy == "fsdp2":
        from torch.distributed.fsdp import fully_shard  # noqa: F401


__all__ = ["Strategy", "build_strategy", "preload"]
