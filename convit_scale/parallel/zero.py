"""DeepSpeed ZeRO stages 1/2/3 with DeepSpeed's own (sharded) checkpoints."""

from __future__ import annotations

from pathlib import Path

import torch

from .base import Strategy


# DeepSpeed's own defaults, sized for GPUs (deepspeed/runtime/zero/config.py)
GPU_DEFAULTS = {"bucket": int(5e8), "overlap_comm": True, "param_persistence_threshold": int(1e5),
                "prefetch_bucket": int(5e7), "max_live_parameters": int(1e9), "max_reuse_distance": int(1e9),
                "sub_group_size": int(1e9)}


def zero_sizes(p, num_params: int, device: torch.device | str = "cpu") -> dict:
    """The ZeRO buffer sizes (elements) and switches for ``p`` (a ParallelConfig) on ``device``.

    Each ``parallel.zero_*`` key that is set wins. Unset ones take DeepSpeed's defaults on CUDA; on CPU
    they are sized from the model, because DeepSpeed's defaults cost more memory than a small model (and
    on CPU ZeRO-3 with them used more memory per rank than DDP): buckets, prefetch, live parameters,
    reuse distance and optimizer sub-groups of ``zero_bucket_elements`` or a tenth of the model within
    [1e6, 5e8], no overlap of communication (no streams to overlap on), every parameter sharded
    (persistence threshold 0).
    The engine (``deepspeed_config``) and the planner both read their sizes from here.
    """
    if torch.device(device).type == "cuda":
        auto = {**GPU_DEFAULTS, "bucket": p.zero_bucket_elements or GPU_DEFAULTS["bucket"]}
    else:
        b = p.zero_bucket_elements or int(min(5e8, max(1e6, num_params / 10)))
        auto = {"bucket": b, "overlap_comm": False, "param_persistence_threshold": 0, "prefetch_bucket": b,
                "max_live_parameters": b, "max_reuse_distance": b, "sub_group_size": b}
    chosen = {"overlap_comm": p.zero_overlap_comm, "param_persistence_threshold": p.zero_param_persistence_threshold,
              "prefetch_bucket": p.zero_prefetch_bucket_elements, "max_live_parameters": p.zero_max_live_parameters,
              "max_reuse_distance": p.zero_max_reuse_distance}
    return {**auto, **{k: v for k, v in chosen.items() if v is not None}}


def deepspeed_config(p, micro_batch: int, grad_accum: int, world_size: int, num_params: int,
                     grad_clip: float | None = None, device: torch.device | str = "cpu") -> dict:
    """The DeepSpeed config of a ZeRO run; buffer sizes and switches from ``zero_sizes``."""
    stage = int(p.strategy[-1])
    z = zero_sizes(p, num_params, device)
    zero = {"stage": stage, "reduce_bucket_size": z["bucket"], "allgather_bucket_size": z["bucket"],
            "overlap_comm": z["overlap_comm"], "contiguous_gradients": True}
    if stage == 3:
        zero.update(stage3_prefetch_bucket_size=z["prefetch_bucket"],
                    stage3_max_live_parameters=z["max_live_parameters"],
                    stage3_max_reuse_distance=z["max_reuse_distance"],
                    # the optimizer steps one sub-group at a time, with a flat fp32 gradient copy and the
                    # optimizer's temporaries per sub-group: on CPU a whole-model sub-group (DeepSpeed's
                    # 1e9) doubles them, so there it is a bucket
                    sub_group_size=z["sub_group_size"],
                    # parameters under the threshold stay whole on every rank; 0 shards them all
                    stage3_param_persistence_threshold=z["param_persistence_threshold"])
    if p.zero_offload:
        zero["offload_optimizer"] = {"device": "cpu", "pin_memory": torch.cuda.is_available()}
    return {
        "train_micro_batch_size_per_gpu": micro_batch,
        "gradient_accumulation_steps": grad_accum,
        "train_batch_size": micro_batch * grad_accum * world_size,
        "zero_optimization": zero,
        # DeepSpeed clips at 1.0 unless told: the loop clips (or not) as the recipe says.
        "gradient_clipping": grad_clip or 0.0,
        "bf16": {"enabled": p.precision == "bf16"},
        "fp16": {"enabled": p.precision == "fp16", "loss_scale": 0, "initial_scale_power": 16},
        "zero_allow_untested_optimizer": True,
        "steps_per_print": 1 << 30,
        "wall_clock_breakdown": False,
    }


def share_fp32_master_partitions() -> None:
    """Let ZeRO-3 use its fp32 parameter partitions as the master weights instead of a copy of them.

    DeepSpeed means to: when the partitioned parameters already have the master dtype on the optimizer's
    device (fp32 training), ``_create_fp32_partitions`` reuses them. Its test compares a ``torch.device``
    with a device string, which is never equal, so it clones them: 4 more bytes per parameter, 1.25x of the
    16-byte ideal before any buffer. This wraps that method and puts the partitions back where the copy
    is an exact duplicate (same dtype, device and size; not offloaded, swapped or Muon-driven). Mixed
    precision (bf16/fp16 partitions, fp32 master) is untouched. Idempotent.
    """
    from deepspeed.runtime.zero.stage3 import DeepSpeedZeroOptimizer_Stage3 as Stage3

    original = Stage3._create_fp32_partitions
    if getattr(original, "_shares_partitions", False):
        return

    def create_fp32_partitions(self):
        original(self)
        if self.offload_optimizer or getattr(self, "use_muon", False) or getattr(self, "swap_optimizer", False):
            return
        for i, (lp, fp32) in enumerate(zip(self.fp16_partitioned_groups_flat, self.fp32_partitioned_groups_flat)):
            if (lp.dtype == fp32.dtype and lp.device == fp32.device and lp.numel() == fp32.numel() > 0
                    and lp.data_ptr() != fp32.data_ptr() and fp32 not in self.optimizer.state):
                lp.ds_id = fp32.ds_id
                lp.requires_grad = True
                self.fp32_partitioned_groups_flat[i] = lp

    create_fp32_partitions._shares_partitions = True
    Stage3._create_fp32_partitions = create_fp32_partitions


def cpu_adam_like(optimizer: torch.optim.Optimizer):
    """The same AdamW (parameter groups, betas, eps, weight decay) as DeepSpeed's vectorised CPU Adam,
    which ZeRO-Offload steps on the host: DeepSpeed refuses a torch optimizer there. The extension is
    compiled on first use (about a minute, cached in TORCH_EXTENSIONS_DIR)."""
    from deepspeed.ops.adam import DeepSpeedCPUAdam

    d = optimizer.defaults
    groups = [{"params": g["params"], "weight_decay": g["weight_decay"]} for g in optimizer.param_groups]
    return DeepSpeedCPUAdam(groups, lr=d["lr"], betas=d["betas"], eps=d["eps"], weight_decay=d["weight_decay"],
                            adamw_mode=True)


def skip_shm_comm_build() -> None:
    """DeepSpeed's CPU backend compiles a shared-memory all-reduce (deepspeed_shm_comm) at its first init on each
    machine: about a minute of C++ on 2 cores, for an op that only its tensor-parallel inference calls
    (``inference_all_reduce``). Training's collectives go through torch.distributed, and with the op marked
    unavailable ``inference_all_reduce`` does too."""
    import deepspeed.ops

    deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False


class ZeroStrategy(Strategy):
    """DeepSpeed ZeRO-1/2/3. DeepSpeed clips and steps inside its engine, and discards a step whose gradient norm
    is not finite itself (its overflow check): the step happens in ``clip_gradients``, at the accumulation
    boundary, so that DeepSpeed's own accumulation state is reset whether or not the update was applied."""

    name = "zero"

    def setup(self, optimizer_fn, micro_batch: int, grad_accum: int) -> None:
        import deepspeed

        if self.p.activation_checkpointing:
            self.module.set_grad_checkpointing(True)
        num_params = sum(p.numel() for p in self.module.parameters())
        optimizer = optimizer_fn(self.module)
        if self.p.zero_offload:
            optimizer = cpu_adam_like(optimizer)
        cfg = deepspeed_config(self.p, micro_batch, grad_accum, self.world_size, num_params, self.grad_clip,
                               device=self.device)
        share_fp32_master_partitions()
        if self.device.type == "cpu":
            skip_shm_comm_build()
        self._engine, self.optimizer, _, _ = deepspeed.initialize(model=self.module, optimizer=optimizer, config=cfg)
        self.wrapped = self._engine
        self.module = self._engine.module
        self.scales_loss = self.p.precision == "fp16"  # DeepSpeed's dynamic loss scaling

    def autocast(self):
        import contextlib

        return contextlib.nullcontext()  # DeepSpeed holds bf16/fp16 parameters itself

    def forward(self, x):
        if self.p.precision != "fp32":
            x = x.to(torch.bfloat16 if self.p.precision == "bf16" else torch.float16)
        return self._engine(x)

    def backward(self, loss, is_last_micro, grad_accum):
        self._engine.set_gradient_accumulation_boundary(is_last_micro)
        self._engine.backward(loss)  # DeepSpeed divides by gradient_accumulation_steps itself

    def clip_gradients(self):
        # clipping was configured at set-up (DeepSpeed's ZeRO optimizers take it at construction)
        self._engine.set_gradient_accumulation_boundary(True)
        self._engine.step()
        norm = self._engine.get_global_grad_norm()
        if norm is None or not self._engine.was_step_applied():
            norm = float("inf")  # DeepSpeed found the gradients non-finite and discarded the update
        return torch.as_tensor(float(norm), device=self.device)

    def step(self):
        pass  # taken in clip_gradients

    def skip_step(self):
        # DeepSpeed already discarded a step whose gradients were not finite (a non-finite loss gives such
        # gradients); its accumulation boundary has passed, so nothing is left to reset.
        self._engine.zero_grad()

    def set_lr(self, lr):
        for g in self._engine.optimizer.param_groups:
            g["lr"] = lr

    def save(self, directory: Path) -> None:
        self._engine.save_checkpoint(str(directory), tag="zero", save_latest=False)

    def load(self, directory: Path) -> None:
        path, _ = self._engine.load_checkpoint(str(directory), tag="zero", load_lr_scheduler_states=False)
        if path is None:
            raise FileNotFoundError(f"{directory}: no DeepSpeed checkpoint")

    def full_state_dict(self):
        if self._engine.zero_optimization_stage() == 3:
            sd = self._engine._zero3_consolidated_16bit_state_dict()  # gathers to rank 0
        else:
            sd = self._engine.module.state_dict()
        if torch.distributed.get_rank() != 0:
            return None
        return {k: v.detach().float().cpu().clone() for k, v in sd.items()}

    def load_full_state_dict(self, state):
        import deepspeed

        params = list(self._engine.module.parameters())
        with deepspeed.zero.GatheredParameters(params, modifier_rank=0, enabled=self._engine.zero_optimization_stage() == 3):
            self._engine.module.load_state_dict(state)

    def optimizer_tensors(self) -> list[torch.Tensor]:
        inner = getattr(self.optimizer, "optimizer", self.optimizer)  # the torch optimizer over fp32 partitions
        out = [p for g in inner.param_groups for p in g["params"]]
        return out + [v for st in inner.state.values() for v in st.values() if isinstance(v, torch.Tensor)]
