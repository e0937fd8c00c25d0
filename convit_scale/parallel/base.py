"""The one interface every strategy (DDP, FSDP2, DeepSpeed ZeRO) implements for the loop, and the model contract
the strategies rely on.

Two names, never more: ``wrapped`` is the module the loop calls (DDP, an FSDP2-sharded model, a DeepSpeed
engine), ``module`` is the ConViT itself (its parameters may be sharded).

A step, in order:
1. ``forward`` and ``backward`` per micro-batch, inside ``micro_batch`` (gradients are reduced on the last one);
2. ``grad_square_sum``: this rank's share of the squared gradient norm, a device tensor the loop folds into the
   step's one packed all-reduce (no host synchronisation, no collective of its own);
3. the loop reads the reduced values once and decides: ``step(grad_norm)`` applies the update (clipped to
   ``grad_clip`` with the global norm), ``skip_step()`` discards the step's gradients and leaves weights and
   optimizer state exactly as they were. Nothing touches the weights before that decision.
"""

from __future__ import annotations

import contextlib
import math
from pathlib import Path
from typing import Protocol, runtime_checkable

import torch
from torch import nn

from .. import comm
from ..config import ParallelConfig

SAVE_GROUP_TIMEOUT_S = 7200
"""The background saves' gloo group waits this long for the slowest rank's write (a checkpoint of many GB on a busy
shared file system), past the process group's timeout of the steps, which ``comm.set_timeout`` leaves out of it. A
write that hangs is ended before that by the watchdog of the next save, which waits for it in its long phase
(``fault.long_phase_timeout_s``)."""


@runtime_checkable
class ShardableModel(Protocol):
    """What the strategies rely on in a model (every registered ConViT/DeiT has it)."""

    blocks: nn.ModuleList
    """The transformer blocks: FSDP2 shards each one, torch.compile compiles each one."""

    def set_grad_checkpointing(self, enable: bool = True) -> None:
        """Recompute each block in backward (activation checkpointing)."""

    def init_weights(self) -> None:
        """Initialise every parameter and buffer in place: after ``to_empty`` on FSDP2 shards (meta init)."""

    def no_weight_decay(self) -> set[str]:
        """Names of parameters trained without weight decay besides biases and norms."""

    def drop_path_keep(self, seeds: torch.Tensor) -> torch.Tensor | None:
        """The drop-path decisions of a batch from its samples' seeds, for ``forward(x, drop_path_keep=...)``."""


class Strategy:
    """Owns the wrapped model and its optimizer; the loop only calls these methods."""

    name = "base"
    scales_loss = False
    """True where a loss scaler (fp16) owns overflowing gradients: it skips those steps and lowers the scale
    itself, so a non-finite gradient norm is not a bad step there (a non-finite loss still is)."""
    norm_is_global = True
    """Whether the reduced ``grad_square_sum`` is the squared global gradient norm (else only its finiteness is:
    DeepSpeed reduces gradients into partitions of its own, and reports the norm itself)."""
    layout_note: str | None = None
    """A line for the run's log on the layout chosen at set-up (FSDP2: an HSDP replica count that did not fit)."""

    def __init__(self, model: nn.Module, p: ParallelConfig, device: torch.device, world_size: int,
                 grad_clip: float | None = None):
        if not isinstance(model, ShardableModel):
            raise TypeError(f"{type(model).__name__} lacks the model contract the strategies rely on "
                            f"(blocks, set_grad_checkpointing, init_weights, no_weight_decay, drop_path_keep)")
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

    def forward(self, x: torch.Tensor, drop_path_keep: torch.Tensor | None = None):
        """The wrapped model's forward; ``drop_path_keep`` (training: ``module.drop_path_keep`` of the batch's sample
        seeds, on the device) makes each sample's drop-path masks a function of its seed."""
        with self.autocast():
            return self.wrapped(x) if drop_path_keep is None else self.wrapped(x, drop_path_keep=drop_path_keep)

    def micro_batch(self, is_last_micro: bool):
        """A context around one micro-batch's forward and backward: where gradients are reduced only on the last
        micro-batch of a step and the wrapper decides that in forward (DDP), it must hold both."""
        return contextlib.nullcontext()

    def backward(self, loss: torch.Tensor, is_last_micro: bool, grad_accum: int) -> None:
        raise NotImplementedError

    def grad_square_sum(self) -> torch.Tensor:
        """This rank's share of the step's squared gradient norm, a float64 scalar on the device (no host
        synchronisation): summed over the ranks it is the squared global norm before clipping, non-finite exactly
        when some gradient value is. Called once per step, after the last backward."""
        raise NotImplementedError

    def step(self, grad_norm: float | None) -> None:
        """Apply the update of a good step (gradients clipped to ``grad_clip`` with the global ``grad_norm``) and
        zero the gradients."""
        raise NotImplementedError

    def skip_step(self) -> None:
        """Discard the gradients of a bad step; weights and optimizer state stay exactly as they were."""
        self.optimizer.zero_grad(set_to_none=True)

    def reported_grad_norm(self) -> float | None:
        """The global gradient norm of the last step where the strategy measures it itself (a host read: for log
        steps only); None where ``grad_square_sum`` already gave it."""
        return None

    def set_lr(self, lr: float) -> None:
        for g in self.optimizer.param_groups:
            g["lr"] = lr

    def train(self, mode: bool = True) -> None:
        self.wrapped.train(mode)

    def close(self) -> None:
        """Release what the wrapper holds beyond the run (hooks, buffers), so that a next run in the same process
        starts clean."""

    # -- state ---------------------------------------------------------------------------------
    def save(self, directory: Path) -> None:
        raise NotImplementedError

    def save_async(self, directory: Path):
        """Start a save whose files are written beside training (``checkpoint.async_save``); returns an object whose
        ``result()`` waits for (or does) the write, which the background publication calls on a thread of its own.
        Its collectives go through ``save_group``."""
        raise NotImplementedError(f"strategy {self.name} has no save beside training (checkpoint.async_save)")

    save_group = None
    """The gloo group of the background saves' collectives (``background_group``, made at the first one), with its
    own timeout (``SAVE_GROUP_TIMEOUT_S``)."""

    def background_group(self):
        """``save_group``, made at the first background save (a collective: every rank reaches its first save).
        Under NCCL the step's collectives go on while the publication's go through it."""
        if self.save_group is None and comm.is_initialized():
            self.save_group = comm.patient_gloo_group(SAVE_GROUP_TIMEOUT_S)
        return self.save_group

    def load(self, directory: Path, saved_world_size: int) -> None:
        """Load the state ``save`` wrote into ``directory`` on ``saved_world_size`` ranks (any world size may load
        it: the strategies reshard)."""
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


def local_grads(params) -> list[torch.Tensor]:
    """The gradients this rank holds, as plain tensors (an FSDP2 DTensor gradient: its local shard)."""
    grads = [p.grad for p in params if p.grad is not None]
    return [g.to_local() if hasattr(g, "to_local") else g for g in grads]


def square_sum(grads: list[torch.Tensor], device: torch.device, dtype: torch.dtype | None = None) -> torch.Tensor:
    """sum of squares of ``grads`` as a float64 scalar on their device: one multi-tensor norm kernel, no host sync;
    ``dtype``: the norms' accumulation dtype (else each gradient's own)."""
    if not grads:
        return torch.zeros((), dtype=torch.float64, device=device)
    norms = torch._foreach_norm(grads) if dtype is None else torch._foreach_norm(grads, 2, dtype=dtype)
    return torch.stack(norms).double().pow(2).sum()


def clip_(grads: list[torch.Tensor], grad_clip: float | None, grad_norm: float | None) -> None:
    """torch's ``clip_grad_norm_`` rule with the norm already known on the host: scale by
    grad_clip / (norm + 1e-6) when that is below 1. The factor is a Python number: no device value is read."""
    if grad_clip is None or grad_norm is None or not math.isfinite(grad_norm):
        return
    coef = grad_clip / (grad_norm + 1e-6)
    if coef < 1.0 and grads:
        torch._foreach_mul_(grads, coef)
