"""``parallel.strategy = none``: one process trains the model itself, with no gradient synchronisation and no
wrapper (``train/distributed.py`` refuses it on more than one rank); DCP checkpoints, as DDP's."""

from __future__ import annotations

import torch

from .base import Strategy, clip_, local_grads, square_sum
from .dcp import DCPStateMixin


class SingleProcessStrategy(DCPStateMixin, Strategy):
    """The plain module on this process's device; fp16 through torch's GradScaler. DDP extends it with the wrapper
    and its gradient all-reduce."""

    name = "none"

    def setup(self, optimizer_fn, micro_batch: int, grad_accum: int) -> None:
        self.module = self.module.to(self.device)
        if self.p.activation_checkpointing:  # non-reentrant checkpointing: DDP's hooks fire once per parameter
            self.module.set_grad_checkpointing(True)
        self.wrapped = self.wrap(self.module)
        if self.p.compile:
            self.wrapped = torch.compile(self.wrapped)
        self.optimizer = optimizer_fn(self.module)
        self.scaler = torch.amp.GradScaler(self.device.type) if self.p.precision == "fp16" else None
        self.scales_loss = self.scaler is not None

    def wrap(self, module: torch.nn.Module) -> torch.nn.Module:
        """What ``forward`` calls: the module itself."""
        return module

    def backward(self, loss, is_last_micro, grad_accum):
        loss = loss / grad_accum
        (self.scaler.scale(loss) if self.scaler else loss).backward()

    def _unscaled_square_sum(self) -> torch.Tensor:
        if self.scaler:
            self.scaler.unscale_(self.optimizer)  # the norm of the true gradients (found-inf stays on the device)
        return square_sum(local_grads(self.module.parameters()), self.device)

    def grad_square_sum(self):
        return self._unscaled_square_sum()

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
