"""Training strategies behind one interface: DDP, FSDP2, DeepSpeed ZeRO-1/2/3."""

from .base import Strategy


def build_strategy(model, p, device, world_size, grad_clip=None) -> Strategy:
    if p.strategy in ("none", "ddp"):
        from .ddp import DDPStrategy

        return DDPStrategy(model, p, device, world_size, grad_clip)
    if p.strategy == "fsdp2":
        from .fsdp2 import FSDP2Strategy

        return FSDP2Strategy(model, p, device, world_size, grad_clip)
    from .zero import ZeroStrategy

    return ZeroStrategy(model, p, device, world_size, grad_clip)


__all__ = ["Strategy", "build_strategy"]
