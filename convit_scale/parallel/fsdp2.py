"""FSDP2 (``fully_shard``), optionally HSDP across node groups, with DCP checkpoints."""

from __future__ import annotations

import contextlib
import os
import re

import torch
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

from .base import Strategy, clip_, local_grads, square_sum
from .dcp import DCPStateMixin


def ranks_per_node(world_size: int) -> int:
    """This node's ranks: torchrun's LOCAL_WORLD_SIZE, else Slurm's tasks per node of the step (srun starts the
    ranks), else the whole world (one node)."""
    for key in ("LOCAL_WORLD_SIZE", "SLURM_STEP_TASKS_PER_NODE", "SLURM_NTASKS_PER_NODE", "SLURM_TASKS_PER_NODE"):
        found = re.match(r"\d+", os.environ.get(key, ""))
        if found:
            return int(found.group())
    return world_size


class FSDP2Strategy(DCPStateMixin, Strategy):
    name = "fsdp2"

    def setup(self, optimizer_fn, micro_batch: int, grad_accum: int) -> None:
        p, model = self.p, self.module
        # HSDP from the ranks per node of this start (a requeue may bring fewer nodes): shard groups never straddle
        # nodes, and a replica count that no longer fits the world does not stop a resume (DCP reshards)
        replicas, self.layout_note = p.hsdp_mesh(self.world_size, ranks_per_node(self.world_size))
        if replicas > 1:
            mesh = init_device_mesh(self.device.type, (replicas, self.world_size // replicas),
                                    mesh_dim_names=("replicate", "shard"))
            # each shard is held by every replica: the first replica alone contributes it to the gradient norm
            self._counts_norm = mesh.get_local_rank("replicate") == 0
        else:
            mesh = init_device_mesh(self.device.type, (self.world_size,))
            self._counts_norm = True
        mp = None  # fp16 is refused with fsdp2 by the recipe's validation (config.py)
        if p.precision == "bf16":  # bf16 compute and all-gathers, fp32 gradient reduction and master weights
            mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        kwargs = dict(mesh=mesh, reshard_after_forward=p.reshard_after_forward)
        if mp is not None:
            kwargs["mp_policy"] = mp
        # Order (as in torchtitan): activation checkpointing -> compile -> shard blocks -> shard root. The
        # model's forward wraps each (compiled) block in torch.utils.checkpoint, so checkpointing sits outside
        # compile: the compiled block is recomputed whole in backward.
        if p.activation_checkpointing:
            model.set_grad_checkpointing(True)
        for i, block in enumerate(model.blocks):
            if p.compile:
                model.blocks[i] = block = torch.compile(block)
            fully_shard(block, **kwargs)
        # The root keeps patch embedding, tokens, norm and head; it need not reshard after forward.
        fully_shard(model, **{**kwargs, "reshard_after_forward": False})
        if p.meta_init:  # built on the meta device: materialise the local shards, then initialise them
            model.to_empty(device=self.device)
            model.init_weights()
        self.wrapped = model
        self.optimizer = optimizer_fn(model)

    def autocast(self):
        return contextlib.nullcontext()  # the MixedPrecisionPolicy casts parameters and inputs

    def forward(self, x, drop_path_keep=None):
        return self.wrapped(x) if drop_path_keep is None else self.wrapped(x, drop_path_keep=drop_path_keep)

    def backward(self, loss, is_last_micro, grad_accum):
        # Accumulate locally; reduce-scatter only on the last micro-batch of the step.
        self.wrapped.set_requires_gradient_sync(is_last_micro)
        (loss / grad_accum).backward()

    def grad_square_sum(self):
        own = square_sum(local_grads(self.module.parameters()), self.device)  # this rank's shards
        return own if self._counts_norm else torch.zeros_like(own)

    def step(self, grad_norm):
        clip_(local_grads(self.module.parameters()), self.grad_clip, grad_norm)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
