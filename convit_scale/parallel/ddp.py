"""DDP (one process: the plain module, still through DDP's code path when a process group exists) with DCP
checkpoints."""

from __future__ import annotations

import contextlib
import inspect

import torch
from torch.nn.parallel import DistributedDataParallel as DDP

from .. import comm
from .base import Strategy, clip_, local_grads, square_sum
from .dcp import DCPStateMixin

# DDP broadcasts module buffers from rank 0 before every synced forward unless told not to; torch 2.14 renamed the
# switch (``forward_sync_buffers``) and deprecated the old one, which older releases alone know.
NO_BUFFER_SYNC = ({"forward_sync_buffers": False} if "forward_sync_buffers" in inspect.signature(DDP).parameters
                  else {"broadcast_buffers": False})


class DDPStrategy(DCPStateMixin, Strategy):
    name = "ddp"

    def setup(self, optimizer_fn, micro_batch: int, grad_accum: int) -> None:
        self.module = self.module.to(self.device)
        if self.p.activation_checkpointing:  # non-reentrant checkpointing: DDP's hooks fire once per parameter
            self.module.set_grad_checkpointing(True)
        self.wrapped = self.module
        if comm.is_initialized() and self.p.strategy != "none":  # world size 1 too: DDP.s collectives reach NCCL
            # gradients live in the communication buckets: no second copy of them (4 bytes/param saved); the GPSA
            # position buffers are deterministic (built from the grid), so DDP need not broadcast them every forward
            self.wrapped = DDP(self.module, device_ids=[self.device.index] if self.device.type == "cuda" else None,
                               gradient_as_bucket_view=True, **NO_BUFFER_SYNC)
        if self.p.compile:
            self.wrapped = torch.compile(self.wrapped)
        self.optimizer = optimizer_fn(self.module)
        self.scaler = torch.amp.GradScaler(self.device.type) if self.p.precision == "fp16" else None
        self.scales_loss = self.scaler is not None

    def micro_batch(self, is_last_micro):
        # DDP prepares its reducer in forward: no_sync must hold the forward too, or every micro-batch all-reduces
        ddp = getattr(self.wrapped, "_orig_mod", self.wrapped)  # under torch.compile
        return contextlib.nullcontext() if is_last_micro or not isinstance(ddp, DDP) else ddp.no_sync()

    def backward(self, loss, is_last_micro, grad_accum):
        loss = loss / grad_accum
        (self.scaler.scale(loss) if self.scaler else loss).backward()

    def grad_square_sum(self):
        if self.scaler:
            self.scaler.unscale_(self.optimizer)  # the norm of the true gradients (found-inf stays on the device)
        # after DDP's all-reduce every rank holds the same gradients: rank 0 alone contributes them
        own = square_sum(local_grads(self.module.parameters()), self.device)
        return own if comm.rank() == 0 else torch.zeros_like(own)

    def step(self, grad_norm):
        clip_(local_grads(self.module.parameters()), self.grad_clip, grad_norm)
        if self.scaler:
            self.scaler.step(self.optimizer)  # skips the step itself when the scaled gradients overflowed
            self.scaler.update()
        else:
            self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)

    def skip_step(self):
        if self.scaler:
            self.scaler.update()  # closes the unscale_ of this step (and lowers the scale on an overflow)
        self.optimizer.zero_grad(set_to_none=True)
