"""The DeepSpeed config of a ZeRO run and the buffer sizes in it: one function (``zero_sizes``) that the engine
(``deepspeed_config``), the planner and ``bench memory`` all read, so that what is planned is what runs.

Imports no DeepSpeed: the planner sizes a run on a machine without it.
"""

from __future__ import annotations

import torch

# DeepSpeed's own defaults, sized for GPUs (deepspeed/runtime/zero/config.py)
GPU_DEFAULTS = {"bucket": int(5e8), "overlap_comm": True, "param_persistence_threshold": int(1e5),
                "prefetch_bucket": int(5e7), "max_live_parameters": int(1e9), "max_reuse_distance": int(1e9),
                "sub_group_size": int(1e9)}
BUCKET_ALIGN = 8
"""Bucket sizes are multiples of this: DeepSpeed's ZeRO-1/2 refuse an all-gather bucket that is not a multiple of
their NCCL alignment (2 elements; a tenth of ConViT-B+ is 15,313,485.6)."""
BUCKET_RANGE = (int(1e6), int(5e8))
"""Bucket sizes (elements) are a tenth of the model within this range, unless ``parallel.zero_bucket_elements``
says otherwise: with DeepSpeed's 5e8 a model of up to 500M parameters (ConViT-B+ has 153M) fills one bucket, whose
reduction starts only after the whole backward; a tenth lets nine tenths of the reduction overlap it."""


def zero_sizes(p, num_params: int, device: torch.device | str = "cpu") -> dict:
    """The ZeRO buffer sizes (elements) and switches for ``p`` (a ParallelConfig) on ``device``.

    Each ``parallel.zero_*`` key that is set wins. Buckets (reduce and all-gather) are ``zero_bucket_elements`` or a
    tenth of the model within ``BUCKET_RANGE`` on any device. The other keys take DeepSpeed's defaults on CUDA; on
    CPU they are sized from the model too, because DeepSpeed's defaults cost more memory than a small model (and on
    CPU ZeRO-3 with them used more memory per rank than DDP): prefetch, live parameters, reuse distance and
    optimizer sub-groups of a bucket, no overlap of communication (no streams to overlap on), every parameter
    sharded (persistence threshold 0). The engine (``deepspeed_config``) and the planner both read their sizes
    from here.
    """
    low, high = BUCKET_RANGE
    bucket = p.zero_bucket_elements or -(-int(min(high, max(low, num_params / 10))) // BUCKET_ALIGN) * BUCKET_ALIGN
    if torch.device(device).type == "cuda":
        auto = {**GPU_DEFAULTS, "bucket": bucket}
    else:
        auto = {"bucket": bucket, "overlap_comm": False, "param_persistence_threshold": 0, "prefetch_bucket": bucket,
                "max_live_parameters": bucket, "max_reuse_distance": bucket, "sub_group_size": bucket}
    chosen = {"overlap_comm": p.zero_overlap_comm, "param_persistence_threshold": p.zero_param_persistence_threshold,
              "prefetch_bucket": p.zero_prefetch_bucket_elements, "max_live_parameters": p.zero_max_live_parameters,
              "max_reuse_distance": p.zero_max_reuse_distance}
    return {**auto, **{k: v for k, v in chosen.items() if v is not None}}


def deepspeed_config(p, micro_batch: int, grad_accum: int, world_size: int, num_params: int,
                     grad_clip: float | None = None, device: torch.device | str = "cpu",
                     bf16_overflow_check: bool = True) -> dict:
    """The DeepSpeed config of a ZeRO run; buffer sizes and switches from ``zero_sizes``. ``bf16_overflow_check``
    False turns DeepSpeed's own bf16 overflow check off (``bf16.check_grad_overflow``; only for a release that has
    the key: ``zero_engine.knows_bf16_overflow_switch``): the strategy's bad-step gate already decided the step."""
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
    bf16 = {"enabled": p.precision == "bf16"}
    if p.precision == "bf16" and not bf16_overflow_check:
        bf16["check_grad_overflow"] = False
    return {
        "train_micro_batch_size_per_gpu": micro_batch,
        "gradient_accumulation_steps": grad_accum,
        "train_batch_size": micro_batch * grad_accum * world_size,
        "zero_optimization": zero,
        # DeepSpeed clips at 1.0 unless told: the loop clips (or not) as the recipe says.
        "gradient_clipping": grad_clip or 0.0,
        "bf16": bf16,
        "fp16": {"enabled": p.precision == "fp16", "loss_scale": 0, "initial_scale_power": 16},
        # gradients reduced and accumulated in fp32, as FSDP2's reduce_dtype: bf16 sums of 32 ranks lose digits
        "communication_data_type": "fp32",
        "zero_allow_untested_optimizer": True,
        "steps_per_print": 1 << 30,
        "wall_clock_breakdown": False,
        # DeepSpeed's throughput timer synchronizes the device twice per step from step 2 on (a host wait at the
        # start and the end of every step) only to log samples/s, which the loop measures itself. The key is read by
        # deepspeed/utils/config.py (get_timers_config) in every release of the pyproject range: 0.16.0 has the
        # same key and default.
        "timers": {"throughput": {"enabled": False}},
    }
