"""DDP (and 'none': one process, or replicas without any wrapper) with DCP checkpoints."""

from __future__ import annotations

import contextlib
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict
from torch.nn.parallel import DistributedDataParallel as DDP

from .base import Strategy, clip_and_norm


class DCPStateMixin:
    """torch.distributed.checkpoint for model + optimizer; it reshards on load (any world size)."""

    def _state(self):
        model_sd, optim_sd = get_state_dict(self.module, self.optimizer)
        return {"model": model_sd, "optim": optim_sd}

    def save(self, directory: Path) -> None:
        dcp.save(self._state(), checkpoint_id=str(directory / "dcp"))

    def load(self, directory: Path) -> None:
        state = self._state()
        dcp.load(state, checkpoint_id=str(directory / "dcp"))
        set_state_dict(self.module, self.optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])

    def full_state_dict(self):
        opts = StateDictOptions(full_state_dict=True, cpu_offload=True)
        model_sd, _ = get_state_dict(self.module, [], options=opts)
        return model_sd if torch.distributed.get_rank() == 0 else None

    def load_full_state_dict(self, state):
        opts = StateDictOptions(full_state_dict=True, broadcast_from_rank0=False)
        set_state_dict(self.module, [], model_state_dict=state, options=opts)


class DDPStrategy(DCPStateMixin, Strategy):
    name = "ddp"

    def setup(self, optimizer_fn, micro_batch: int, grad_accum: int) -> None:
        self._module = self.model.to(self.device)
        if self.world_size > 1 and self.p.strategy == "ddp":
            # gradients live in the communication buckets: no second copy of them (4 bytes/param saved)
            self.model = DDP(self._module, device_ids=[self.device.index] if self.device.type == "cuda" else None,
                             gradient_as_bucket_view=True)
        if self.p.compile:
            self.model = torch.compile(self.model)
        self.optimizer = optimizer_fn(self._module)
        self.scaler = torch.amp.GradScaler(self.device.type) if self.p.precision == "fp16" else None

    @property
    def module(self) -> nn.Module:
        return self._module

    def backward(self, loss, is_last_micro, grad_accum):
        sync = contextlib.nullcontext() if is_last_micro or not isinstance(self.model, DDP) else self.model.no_sync()
        with sync:
            loss = loss / grad_accum
            (self.scaler.scale(loss) if self.scaler else loss).backward()

    def step(self):
        if self.scaler:
            self.scaler.unscale_(self.optimizer)
        norm = clip_and_norm(self._module.parameters(), self.grad_clip)
        if self.scaler:
            self.scaler.step(self.optimizer)
            self.scaler.update()
        else:
            self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return norm
