"""DDP (one process: the plain module) with DCP checkpoints."""

from __future__ import annotations

import contextlib

import torch
from torch.nn.parallel import DistributedDataParallel as DDP

from .base import Strategy, clip_and_norm
from .dcp import DCPStateMixin


class DDPStrategy(DCPStateMixin, Strategy):
    name = "ddp"

    def setup(self, optimizer_fn, micro_batch: int, grad_accum: int) -> None:
        self.module = self.module.to(self.device)
        if self.p.activation_checkpointing:  # non-reentrant checkpointing: DDP's hooks fire once per parameter
            self.module.set_grad_checkpointing(True)
        self.wrapped = self.module
        if self.world_size > 1:
            # gradients live in the communication buckets: no second copy of them (4 bytes/param saved)
            self.wrapped = DDP(self.module, device_ids=[self.device.index] if self.device.type == "cuda" else None,
                               gradient_as_bucket_view=True)
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

    def clip_gradients(self):
        if self.scaler:
            self.scaler.unscale_(self.optimizer)
        return clip_and_norm(self.module.parameters(), self.grad_clip)

    def step(self):
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
