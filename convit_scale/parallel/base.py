"""The one small interface every strategy (DDP, FSDP2, DeepSpeed ZeRO) implements for the loop."""

from __future__ import annotations

import contextlib
import math
from pathlib import Path

import torch
from torch import nn

from ..config import ParallelConfig


class Strategy:
    """Owns the wrapped model and its optimizer; the loop only calls these methods."""

    name = "base"

    def __init__(self, model: nn.Module, p: ParallelConfig, device: torch.device, world_size: int,
                 grad_clip: float | None = None):
        self.p, self.device, self.world_size, self.grad_clip = p, device, world_size, grad_clip
        self.model = model  # the module to call for forward (possibly wrapped)
        self.optimizer: torch.optim.Optimizer | None = None

    # -- set-up --------------------------------------------------------------------------------
    def setup(self, optimizer_fn, micro_batch: int, grad_accum: int) -> None:
        raise NotImplementedError

    @property
    def module(self) -> nn.Module:
        """The ConViT itself (parameters may be sharded)."""
        return self.model

    # -- one step ------------------------------------------------------------------------------
    def autocast(self):
        """Autocast for strategies whose parameters stay fp32 (DDP); FSDP2/DeepSpeed cast themselves."""
        if self.p.precision == "fp32":
            return contextlib.nullcontext()
        dtype = torch.bfloat16 if self.p.precision == "bf16" else torch.float16
        return torch.autocast(self.device.type, dtype=dtype)

    def forward(self, x: torch.Tensor):
        with self.autocast():
            return self.model(x)

    def backward(self, loss: torch.Tensor, is_last_micro: bool, grad_accum: int) -> None:
        raise NotImplementedError

    def step(self) -> float:
        """Clip (if the recipe asks), step, zero gradients; returns the global gradient norm before clipping."""
        raise NotImplementedError

    def skip_step(self) -> None:
        """Discard the accumulated gradients of a step with a non-finite loss."""
        self.optimizer.zero_grad(set_to_none=True)

    def set_lr(self, lr: float) -> None:
        for g in self.optimizer.param_groups:
            g["lr"] = lr

    def train(self, mode: bool = True) -> None:
        self.model.train(mode)

    # -- state ---------------------------------------------------------------------------------
    def save(self, directory: Path) -> None:
        raise NotImplementedError

    def load(self, directory: Path) -> None:
        raise NotImplementedError

    def full_state_dict(self) -> dict[str, torch.Tensor] | None:
        """The unsharded fp32 model state dict on rank 0 (None elsewhere); every rank must call it."""
        raise NotImplementedError

    def load_full_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        """Load a full (unsharded) model state dict held on every rank, e.g. published weights."""
        raise NotImplementedError


def clip_and_norm(params, grad_clip: float | None) -> float:
    """Global gradient norm (DTensor-aware); clips when ``grad_clip`` is set."""
    params = [p for p in params if p.grad is not None]
    norm = torch.nn.utils.clip_grad_norm_(params, grad_clip if grad_clip is not None else math.inf)
    if hasattr(norm, "full_tensor"):
        norm = norm.full_tensor()
    return float(norm)
