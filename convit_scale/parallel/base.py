"""The one small interface every strategy (DDP, FSDP2, DeepSpeed ZeRO) implements for the loop.

Two names, never more: ``wrapped`` is the module the loop calls (DDP, an FSDP2-sharded model, a DeepSpeed
engine), ``module`` is the ConViT itself (its parameters may be sharded).

A step is ``backward`` per micro-batch, then ``clip_gradients`` (the global gradient norm stays on the device:
the loop folds its finiteness into the step's one reduction), then ``step`` or ``skip_step``.
"""

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
    scales_loss = False
    """True where a loss scaler (fp16) owns overflowing gradients: it skips those steps and lowers the scale
    itself, so a non-finite gradient norm is not a bad step there (a non-finite loss still is)."""

    def __init__(self, model: nn.Module, p: ParallelConfig, device: torch.device, world_size: int,
                 grad_clip: float | None = None):
        self.p, self.device, self.world_size, self.grad_clip = p, device, world_size, grad_clip
        self.module = model  # the ConViT itself
        self.wrapped: nn.Module = model  # what forward calls; set by setup()
        self.optimizer: torch.optim.Optimizer | None = None

    # -- set-up --------------------------------------------------------------------------------
    def setup(self, optimizer_fn, micro_batch: int, grad_accum: int) -> None:
        raise NotImplementedError

    # -- one step ------------------------------------------------------------------------------
    def autocast(self):
        """Autocast for strategies whose parameters stay fp32 (DDP); FSDP2/DeepSpeed cast themselves."""
        if self.p.precision == "fp32":
            return contextlib.nullcontext()
        dtype = torch.bfloat16 if self.p.precision == "bf16" else torch.float16
        return torch.autocast(self.device.type, dtype=dtype)

    def forward(self, x: torch.Tensor):
        with self.autocast():
            return self.wrapped(x)

    def micro_batch(self, is_last_micro: bool):
        """A context around one micro-batch's forward and backward: where gradients are reduced only on the last
        micro-batch of a step and the wrapper decides that in forward (DDP), it must hold both."""
        return contextlib.nullcontext()

    def backward(self, loss: torch.Tensor, is_last_micro: bool, grad_accum: int) -> None:
        raise NotImplementedError

    def clip_gradients(self) -> torch.Tensor:
        """Clip (if the recipe asks) and return the global gradient norm before clipping, as a tensor on the
        device (no host synchronisation)."""
        raise NotImplementedError

    def step(self) -> None:
        """Apply the optimizer step and zero the gradients."""
        raise NotImplementedError

    def skip_step(self) -> None:
        """Discard the accumulated gradients of a bad step; weights and optimizer state stay as they were."""
        self.optimizer.zero_grad(set_to_none=True)

    def set_lr(self, lr: float) -> None:
        for g in self.optimizer.param_groups:
            g["lr"] = lr

    def train(self, mode: bool = True) -> None:
        self.wrapped.train(mode)

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

    def optimizer_tensors(self) -> list[torch.Tensor]:
        """This rank's share of the weights the optimizer updates and of its state (debug digests)."""
        opt = self.optimizer
        out = [p for g in opt.param_groups for p in g["params"]]
        out += [v for st in opt.state.values() for v in st.values() if isinstance(v, torch.Tensor)]
        return [t.to_local() if hasattr(t, "to_local") else t for t in out]


def clip_and_norm(params, grad_clip: float | None) -> torch.Tensor:
    """Global gradient norm (DTensor-aware) as a device tensor; clips when ``grad_clip`` is set."""
    params = [p for p in params if p.grad is not None]
    norm = torch.nn.utils.clip_grad_norm_(params, grad_clip if grad_clip is not None else math.inf)
    if hasattr(norm, "full_tensor"):
        norm = norm.full_tensor()
    return norm
