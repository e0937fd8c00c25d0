"""DDP: the single-process strategy's model behind DDP's wrapper (whenever a process group exists, at world size 1
too, so that a one-GPU run sends DDP's collectives through NCCL), with DCP checkpoints."""

from __future__ import annotations

import contextlib
import inspect

import torch
from torch.nn.parallel import DistributedDataParallel as DDP

from .. import comm
from .single import SingleProcessStrategy

# DDP broadcasts module buffers from rank 0 before every synced forward unless told not to; torch 2.14 renamed the
# switch (``forward_sync_buffers``) and deprecated the old one, which older releases alone know.
NO_BUFFER_SYNC = ({"forward_sync_buffers": False} if "forward_sync_buffers" in inspect.signature(DDP).parameters
                  else {"broadcast_buffers": False})


class DDPStrategy(SingleProcessStrategy):
    name = "ddp"

    def wrap(self, module: torch.nn.Module) -> torch.nn.Module:
        if not comm.is_initialized():  # a library caller without a process group: nothing to synchronise
            return module
        # gradients live in the communication buckets: no second copy of them (4 bytes/param saved); the GPSA
        # position buffers are deterministic (built from the grid), so DDP need not broadcast them every forward
        return DDP(module, device_ids=[self.device.index] if self.device.type == "cuda" else None,
                   gradient_as_bucket_view=True, **NO_BUFFER_SYNC)

    def micro_batch(self, is_last_micro):
        # DDP prepares its reducer in forward: no_sync must hold the forward too, or every micro-batch all-reduces
        ddp = getattr(self.wrapped, "_orig_mod", self.wrapped)  # under torch.compile
        return contextlib.nullcontext() if is_last_micro or not isinstance(ddp, DDP) else ddp.no_sync()

    def grad_square_sum(self):
        # after DDP's all-reduce every rank holds the same gradients: rank 0 alone contributes them
        own = self._unscaled_square_sum()
        return own if comm.rank() == 0 else torch.zeros_like(own)
