"""DeepSpeed ZeRO stages 1/2/3 with DeepSpeed's own (sharded) checkpoints."""

from __future__ import annotations

from pathlib import Path

import torch

from .base import Strategy


def deepspeed_config(p, micro_batch: int, grad_accum: int, world_size: int, num_params: int,
                     grad_clip: float | None = None) -> dict:
    stage = int(p.strategy[-1])
    # DeepSpeed's default buckets (5e8 elements) are GPU-sized; on a small model or on CPU they cost more
    # memory than the model. Size them from the model: a tenth of it, within [1e6, 5e8].
    bucket = p.zero_bucket_elements or int(min(5e8, max(1e6, num_params / 10)))
    zero = {"stage": stage, "reduce_bucket_size": bucket, "allgather_bucket_size": bucket,
            "overlap_comm": False, "contiguous_gradients": True}
    if stage == 3:
        zero.update(stage3_prefetch_bucket_size=bucket, stage3_max_live_parameters=bucket,
                    stage3_max_reuse_distance=bucket,
                    # parameters under the threshold stay whole on every rank; 0 shards them all
                    stage3_param_persistence_threshold=0)
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


class ZeroStrategy(Strategy):
    name = "zero"

    def setup(self, optimizer_fn, micro_batch: int, grad_accum: int) -> None:
        import deepspeed

        if self.p.activation_checkpointing:
            self.model.set_grad_checkpointing(True)
        self._module = self.model
        num_params = sum(p.numel() for p in self.model.parameters())
        optimizer = optimizer_fn(self.model)
        cfg = deepspeed_config(self.p, micro_batch, grad_accum, self.world_size, num_params, self.grad_clip)
        self.engine, self.optimizer, _, _ = deepspeed.initialize(model=self.model, optimizer=optimizer, config=cfg)
        self.model = self.engine

    @property
    def module(self):
        return self.engine.module

    def autocast(self):
        import contextlib

        return contextlib.nullcontext()  # DeepSpeed holds bf16/fp16 parameters itself

    def forward(self, x):
        if self.p.precision != "fp32":
            x = x.to(torch.bfloat16 if self.p.precision == "bf16" else torch.float16)
        return self.engine(x)

    def backward(self, loss, is_last_micro, grad_accum):
        self.engine.set_gradient_accumulation_boundary(is_last_micro)
        self.engine.backward(loss)  # DeepSpeed divides by gradient_accumulation_steps itself

    def step(self):
        # clipping was configured at set-up (DeepSpeed's ZeRO optimizers take it at construction)
        self.engine.set_gradient_accumulation_boundary(True)
        self.engine.step()
        norm = self.engine.get_global_grad_norm()
        return float(norm) if norm is not None else float("nan")

    def skip_step(self):
        self.engine.zero_grad()

    def set_lr(self, lr):
        for g in self.engine.optimizer.param_groups:
            g["lr"] = lr

    def save(self, directory: Path) -> None:
        self.engine.save_checkpoint(str(directory), tag="zero", save_latest=False)

    def load(self, directory: Path) -> None:
        path, _ = self.engine.load_checkpoint(str(directory), tag="zero", load_lr_scheduler_states=False)
        if path is None:
            raise FileNotFoundError(f"{directory}: no DeepSpeed checkpoint")

    def full_state_dict(self):
        if self.engine.zero_optimization_stage() == 3:
            sd = self.engine._zero3_consolidated_16bit_state_dict()  # gathers to rank 0
        else:
            sd = self.engine.module.state_dict()
        if torch.distributed.get_rank() != 0:
            return None
        return {k: v.detach().float().cpu().clone() for k, v in sd.items()}

    def load_full_state_dict(self, state):
        import deepspeed

        params = list(self.engine.module.parameters())
        with deepspeed.zero.GatheredParameters(params, modifier_rank=0, enabled=self.engine.zero_optimization_stage() == 3):
            self.engine.module.load_state_dict(state)
