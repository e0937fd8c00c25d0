"""DeepSpeed ZeRO stages 1/2/3 with DeepSpeed's own (sharded) checkpoints: the strategy. Its config and sizes are in
``zero_config``, what it adds to DeepSpeed's engine (device, patches, the bad-step gate) in ``zero_engine``, the
resume on another world size in ``universal``."""

from __future__ import annotations

import contextlib
from pathlib import Path

import torch

from .. import comm
from ..extensions import use_own_torch_extensions_dir
from .base import Strategy
from .universal import UNIVERSAL, conversion_wait_s, is_converted, scratch_dir, universal_checkpoint, universal_problem
from .zero_config import deepspeed_config
from .zero_engine import (
    FsyncedFiles,
    OptimizerGate,
    StagedFiles,
    cpu_adam_like,
    deepspeed_args,
    knows_bf16_overflow_switch,
    local_rank_as,
    partition_square_sum,
    place_state_like_torch,
    share_fp32_master_partitions,
    skip_shm_comm_build,
)


class ZeroStrategy(Strategy):
    """DeepSpeed ZeRO-1/2/3. The loop decides on the step before DeepSpeed's engine takes it: after the last backward
    of a step, one multi-tensor norm over the gradients DeepSpeed reduced into this rank's partition
    (``zero_engine.partition_square_sum``) goes into the step's packed reduction; a reduced gradient is non-finite
    exactly when some contribution was. A good step is ``engine.step()``; a bad one is the same call with the
    optimizer gated shut, so DeepSpeed resets its accumulation state and nothing is updated. DeepSpeed's own bf16
    overflow check (an all-reduce and a host read per step) is off where its release has the switch."""

    name = "zero"
    norm_is_global = False  # DeepSpeed clips with the norm it computes in its step, and reports that one

    def setup(self, optimizer_fn, micro_batch: int, grad_accum: int) -> None:
        import deepspeed

        use_own_torch_extensions_dir()  # every op DeepSpeed builds on first use (its CPU Adam among them)
        if self.p.activation_checkpointing:
            self.module.set_grad_checkpointing(True)
        num_params = sum(p.numel() for p in self.module.parameters())
        self._tensors = sum(1 for _ in self.module.parameters())
        optimizer = optimizer_fn(self.module)
        if self.p.zero_offload:
            optimizer = cpu_adam_like(optimizer)
        cfg = deepspeed_config(self.p, micro_batch, grad_accum, self.world_size, num_params, self.grad_clip,
                               device=self.device, bf16_overflow_check=not knows_bf16_overflow_switch())
        share_fp32_master_partitions()
        if self.device.type == "cpu":
            skip_shm_comm_build()
        self._local_rank = contextlib.ExitStack()  # held until close(): ZeRO-3 reads it in its first steps too
        self._local_rank.enter_context(local_rank_as(self.device))
        try:
            self._engine, self.optimizer, _, _ = deepspeed.initialize(args=deepspeed_args(self.device),
                                                                      model=self.module, optimizer=optimizer,
                                                                      config=cfg)
        except BaseException:
            self._local_rank.close()
            raise
        self.wrapped = self._engine
        self.module = self._engine.module
        self.scales_loss = self.p.precision == "fp16"  # DeepSpeed's dynamic loss scaling
        inner = [optimizer] + [o for o in (getattr(self.optimizer, "backup_optimizer", None),) if o is not None]
        self._gate = OptimizerGate(inner)

    def autocast(self):
        return contextlib.nullcontext()  # DeepSpeed holds bf16/fp16 parameters itself

    def forward(self, x, drop_path_keep=None):
        if self.p.precision != "fp32":
            x = x.to(torch.bfloat16 if self.p.precision == "bf16" else torch.float16)
        return self._engine(x) if drop_path_keep is None else self._engine(x, drop_path_keep=drop_path_keep)

    def backward(self, loss, is_last_micro, grad_accum):
        self._engine.set_gradient_accumulation_boundary(is_last_micro)
        self._engine.backward(loss)  # DeepSpeed divides by gradient_accumulation_steps itself

    def grad_square_sum(self):
        return partition_square_sum(self.optimizer, self.device)

    def step(self, grad_norm):
        # clipping was configured at set-up (DeepSpeed's ZeRO optimizers take it at construction)
        self._engine.set_gradient_accumulation_boundary(True)
        self._engine.step()

    def skip_step(self):
        self._engine.set_gradient_accumulation_boundary(True)
        with self._gate.closed():
            self._engine.step()
        self._engine.zero_grad()

    def reported_grad_norm(self) -> float | None:
        """DeepSpeed's global gradient norm of the last step taken (a host read: at log steps only)."""
        norm = self._engine.get_global_grad_norm()
        return None if norm is None else float(norm)

    def close(self) -> None:
        self._engine.destroy()  # DeepSpeed's engine otherwise outlives the run (its hooks and global registries)
        self._local_rank.close()

    def set_lr(self, lr):
        for g in self._engine.optimizer.param_groups:
            g["lr"] = lr

    def save(self, directory: Path) -> None:
        """DeepSpeed's own save, each file flushed to the disk by this rank (``zero_engine.FsyncedFiles``)."""
        self._save_through(FsyncedFiles(self._engine.checkpoint_engine), directory)

    def save_async(self, directory: Path) -> StagedFiles:
        """DeepSpeed's own save, its files serialized into host memory here and written by the background
        publication (``zero_engine.StagedFiles``)."""
        self.background_group()
        staged = StagedFiles(self._engine.checkpoint_engine)
        self._save_through(staged, directory)
        return staged

    def _save_through(self, engine, directory: Path) -> None:
        """``engine.save_checkpoint`` with ``engine`` standing in for its checkpoint engine for this save."""
        inner = self._engine.checkpoint_engine
        self._engine.checkpoint_engine = engine
        try:
            self._engine.save_checkpoint(str(directory), tag="zero", save_latest=False)
        finally:
            self._engine.checkpoint_engine = inner

    def _convert_on_rank0(self, directory: Path, saved_world_size: int) -> Path:
        """Rank 0 converts ``directory`` to a universal checkpoint while the others wait in a patient group (sized by
        the checkpoint's bytes and files); every rank raises rank 0's error alike."""
        error = None
        wait = conversion_wait_s(directory, self.p.timeout_s, self._tensors, saved_world_size)
        with comm.patient_group(wait) as group:
            if comm.rank() == 0:
                try:
                    import deepspeed

                    problem = universal_problem(self.p.strategy, deepspeed.__version__)
                    if problem:
                        raise RuntimeError(problem)
                    universal_checkpoint(directory, scratch_dir(self.p.zero_universal_scratch))
                except Exception as e:  # noqa: BLE001 - every rank raises it below, not only rank 0
                    error = (f"{directory}: DeepSpeed's universal checkpoint conversion failed: "
                             f"{type(e).__name__}: {e}")
            error = comm.broadcast_object(error, group=group)
        if error is None and not is_converted(directory / UNIVERSAL):  # this rank's view of the shared folder
            error = f"{directory / UNIVERSAL}: not a finished conversion on rank {comm.rank()} (no completion mark)"
        if error is not None:
            raise RuntimeError(error)
        return directory / UNIVERSAL

    def load(self, directory: Path, saved_world_size: int | None = None) -> None:
        """DeepSpeed's checkpoint as saved, or, written on another number of ranks, through DeepSpeed's universal
        checkpoint (``universal.universal_checkpoint``: converted once, by rank 0) partitioned anew for this world
        size, its optimizer state then put where torch keeps it (``zero_engine.place_state_like_torch``)."""
        folder = directory
        if saved_world_size is not None and saved_world_size != self.world_size:
            folder = self._convert_on_rank0(directory, saved_world_size)
        config = self._engine._config  # read by load_checkpoint only: set for this load, as the "checkpoint" section's
        # load_universal
        before, config.load_universal_checkpoint = config.load_universal_checkpoint, folder != directory
        inner = getattr(self.optimizer, "optimizer", self.optimizer)  # the torch optimizer over fp32 partitions
        hyper = [{k: v for k, v in g.items() if k != "params"} for g in inner.param_groups]
        try:
            path, _ = self._engine.load_checkpoint(str(folder), tag="zero", load_lr_scheduler_states=False)
        finally:
            config.load_universal_checkpoint = before
        if path is None:
            raise FileNotFoundError(f"{folder}: no DeepSpeed checkpoint")
        for group, values in zip(inner.param_groups, hyper):  # the recipe's (the same recipe resumes): ZeRO-3's
            group.update(values)  # universal load gives every group the first one's, weight decay included
        for state in inner.state.values():  # and one step tensor to every sub-group, which each sub-group's Adam
            if torch.is_tensor(state.get("step")):  # step would then advance: a step counted twice, Adam's bias
                state["step"] = state["step"].clone()  # correction off. One copy each.
        place_state_like_torch(inner)

    def full_state_dict(self):
        """The whole model in fp32 on rank 0: under bf16/fp16 from DeepSpeed's fp32 master partitions (gathered one
        parameter at a time, a collective each), as ``export`` reads them from a checkpoint, not the rounded
        low-precision copy the engine computes with; buffers as the module holds them."""
        engine = self._engine
        if self.p.precision != "fp32":
            sd = self._master_state_dict()
        elif engine.zero_optimization_stage() == 3:
            sd = engine._zero3_consolidated_16bit_state_dict()  # gathers to rank 0
        else:
            sd = engine.module.state_dict()
        if comm.rank() != 0:
            return None
        return {k: v.detach().float().cpu().clone() for k, v in sd.items()}

    def _master_state_dict(self) -> dict[str, torch.Tensor]:
        """The module's state dict with each trainable parameter replaced by its fp32 master (every rank calls it;
        rank 0's is complete, the others' hold buffers only)."""
        import deepspeed
        from deepspeed.utils import safe_get_full_fp32_param

        module, keep = self._engine.module, comm.rank() == 0
        params, buffers = dict(module.named_parameters()), dict(module.named_buffers())
        out = {}
        for name in module.state_dict():
            if name in params:
                p = params[name]
                if p.requires_grad:
                    full = safe_get_full_fp32_param(p)  # all-gather (ZeRO-3) or all-reduce (ZeRO-1/2) of one tensor
                else:
                    with deepspeed.zero.GatheredParameters([p], enabled=hasattr(p, "ds_id")):
                        full = p.detach().float().clone()
                if keep:
                    out[name] = full.detach().cpu()
            elif name in buffers:
                out[name] = buffers[name]
        return out

    def load_full_state_dict(self, state):
        import deepspeed

        params = list(self._engine.module.parameters())
        with deepspeed.zero.GatheredParameters(params, modifier_rank=0,
                                               enabled=self._engine.zero_optimization_stage() == 3):
            self._engine.module.load_state_dict(state)

    def optimizer_tensors(self) -> list[torch.Tensor]:
        inner = getattr(self.optimizer, "optimizer", self.optimizer)  # the torch optimizer over fp32 partitions
        out = [p for g in inner.param_groups for p in g["params"]]
        return out + [v for st in inner.state.values() for v in st.values() if isinstance(v, torch.Tensor)]
