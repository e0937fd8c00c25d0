"""Memory per GPU, micro-batch, accumulation, step time and GPU-hours per strategy (`convit-scale plan`).

Memory model (bytes; P parameters, N ranks sharding, c = 2 in bf16 / 4 in fp32 compute):
- model state with AdamW is 16 bytes per parameter in fp32 (master 4 + gradient 4 + two moments 8):
  ddp 16P (+4P while it rebuilds its buckets after step 1); fsdp2 16P/N (+4P/N of gradient buffers)
  plus the unsharded working set of two blocks (c + 4 bytes per block parameter);
  zero1 keeps parameters and gradients whole (2c P) and shards master + moments (12P/N, or 8P/N in fp32);
  zero2 also shards gradients; zero3 shards everything and keeps the gathered parameters DeepSpeed lets
  live (``stage3_max_live_parameters``, at most the model) and a bucket of gradients being reduced (its
  fp32 partitions double as the master weights in fp32 runs); sizes from ``parallel.zero.zero_sizes``,
  the function that writes the engine's DeepSpeed config, for a GPU or (``--gpu cpu``) the CPU.
- activations: the bytes autograd saves per image, counted exactly by a forward on the meta device
  (no memory used), times the micro-batch; with activation checkpointing, one block's worth plus every
  block's input.
Step time = 3 x forward FLOPs x global batch / (world x peak bf16 FLOP/s x MFU); memory and peaks of the
GPUs from ``hardware.GPUS``.
Loader: the images/s per GPU that step time asks for, against what the CPU cores beside each GPU can decode and
augment (``LOADER_CPU_MS_PER_IMAGE``, measured by ``convit-scale bench data``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from .config import ParallelConfig
from .hardware import GPUS
from .parallel.zero import zero_sizes

IMAGENET_TRAIN = 1_281_167

LOADER_CPU_MS_PER_IMAGE = {
    ("ffcv", "cpu"): 4.93, ("ffcv", "device"): 1.11,
    ("wds", "cpu"): 7.33, ("wds", "device"): 4.30,
    ("imagefolder", "cpu"): 6.35, ("imagefolder", "device"): 4.28,
}
"""CPU milliseconds per training image of one rank's loader (all its workers), full DeiT recipe at 224, by
(data.format, where the augmentation after the crop runs): ``cpu_ms_per_image`` at 1 worker from
``convit-scale bench data --rounds 3 --seconds 5 --device cpu --out runs/bench`` (BENCHMARKS.md, "Data loading";
2 shared x86-64 cores, 500x375 JPEGs; the .beton holds them at a 384-pixel max side)."""


@dataclass
class ModelFacts:
    params: int
    block_params: int
    fwd_flops_per_image: float
    act_bytes_per_image: float
    act_ckpt_bytes_per_image: float


def model_facts(cfg, compute_bytes: int = 2) -> ModelFacts:
    """Parameters, FLOPs and saved-activation bytes per image, all from a meta-device forward."""
    from torch.utils.flop_counter import FlopCounterMode

    from .config import model_options
    from .models import create_model

    dtype = torch.bfloat16 if compute_bytes == 2 else torch.float32
    model = create_model(cfg.model.name, device="meta", **model_options(cfg.model)).to(dtype)
    size = model.patch_embed.img_size[0]

    def saved(batch: int) -> int:
        total = 0

        def pack(t):
            nonlocal total
            total += t.numel() * t.element_size()
            return t

        x = torch.empty(batch, 3, size, size, device="meta", dtype=dtype)
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            out = model(x)
        del out
        return total

    per_image = saved(2) - saved(1)  # the batch-independent part is the weights saved for backward
    x = torch.empty(1, 3, size, size, device="meta", dtype=dtype)
    with FlopCounterMode(display=False) as counter:
        model(x)
    depth = len(model.blocks)
    tokens = model.patch_embed.num_patches + model.num_prefix_tokens
    block_input = tokens * model.embed_dim * compute_bytes
    return ModelFacts(
        params=sum(p.numel() for p in model.parameters()),
        block_params=max(sum(p.numel() for p in b.parameters()) for b in model.blocks),
        fwd_flops_per_image=counter.get_total_flops(),
        act_bytes_per_image=per_image,
        act_ckpt_bytes_per_image=per_image / depth + depth * block_input,
    )


def state_bytes(strategy: str, f: ModelFacts, n: int, c: int, zero: dict | None = None) -> dict[str, float]:
    """Parameters, gradients and optimizer state per rank, in bytes; ``zero``: ``zero_sizes`` (zero3)."""
    P = f.params
    master = 4  # fp32 master weights (and the parameters themselves in fp32 runs)
    if strategy in ("ddp", "none"):
        # DDP rebuilds its gradient buckets after the first iteration: for a moment a second copy of the
        # gradients exists (measured on CPU: peak = 20 bytes/param before activations).
        return {"params": master * P, "grads": 4 * P + (4 * P if strategy == "ddp" else 0), "optimizer": 8 * P}
    if strategy == "fsdp2":
        working = 2 * f.block_params * (c + 4)  # two blocks gathered (prefetch) + their unsharded grads
        # the reduce-scattered gradient shards and their fp32 accumulation buffers coexist for the last
        # blocks of backward (measured on CPU: +4 bytes/param/N)
        return {"params": master * P / n + working, "grads": 8 * P / n, "optimizer": 8 * P / n}
    low = c if c == 2 else 0  # DeepSpeed bf16: a bf16 module copy besides the fp32 master
    if strategy == "zero1":
        return {"params": (low or 4) * P + (master * P / n if low else 0), "grads": (low or 4) * P,
                "optimizer": 8 * P / n}
    if strategy == "zero2":
        return {"params": (low or 4) * P + (master * P / n if low else 0), "grads": (low or 4) * P / n,
                "optimizer": 8 * P / n}
    if zero is None:
        zero = zero_sizes(ParallelConfig(strategy="zero3"), P)
    gathered = min(P, zero["max_live_parameters"])
    # the gathered parameters and one bucket of gradients being reduced (DeepSpeed allocates its ipg
    # bucket whole)
    return {"params": ((low or 4) + (master if low else 0)) * P / n + gathered * (low or 4),
            "grads": (low or 4) * P / n + zero["bucket"] * (low or 4), "optimizer": 8 * P / n}


def plan(cfg, nodes: int, gpus_per_node: int, gpu: str, mfu: float = 0.4,
         strategies=("ddp", "fsdp2", "zero1", "zero2", "zero3")) -> list[dict]:
    mem_gib, peak_tflops = GPUS[gpu].memory_gib, GPUS[gpu].peak_tflops
    c = 4 if cfg.parallel.precision == "fp32" else 2
    facts = model_facts(cfg, c)
    world = nodes * gpus_per_node
    global_batch = cfg.data.global_batch_size
    per_rank = global_batch // world if global_batch % world == 0 else None
    act = facts.act_ckpt_bytes_per_image if cfg.parallel.activation_checkpointing else facts.act_bytes_per_image
    budget = mem_gib * 2**30 * 0.9 - (1.0 * 2**30 if gpu != "cpu" else 0)  # 10% fragmentation, CUDA context
    images = IMAGENET_TRAIN * cfg.data.subset_fraction
    steps = cfg.schedule.epochs * math.floor(images / global_batch)
    step_s = 3 * facts.fwd_flops_per_image * global_batch / (world * peak_tflops * 1e12 * mfu)
    zero = zero_sizes(cfg.parallel, facts.params, "cpu" if gpu == "cpu" else "cuda")
    rows = []
    for s in strategies:
        st = state_bytes(s, facts, world, c, zero)
        fixed = sum(st.values())
        fit = int((budget - fixed) // act) if budget > fixed else 0
        micro = accum = None
        if per_rank is not None and fit > 0:
            micro = max(d for d in range(1, per_rank + 1) if per_rank % d == 0 and d <= fit) if fit >= 1 else None
            accum = per_rank // micro if micro else None
        rows.append({
            "strategy": s, "params_gib": st["params"] / 2**30, "grads_gib": st["grads"] / 2**30,
            "optimizer_gib": st["optimizer"] / 2**30,
            "activations_gib": (act * micro / 2**30) if micro else None,
            "total_gib": (fixed + act * (micro or 0)) / 2**30, "max_micro_batch": fit, "micro_batch": micro,
            "grad_accumulation": accum, "step_s": step_s, "steps": steps,
            "gpu_hours": step_s * steps * world / 3600, "wall_clock_h": step_s * steps / 3600,
        })
    return rows


def loader_check(cfg, gpu: str, cpus_per_gpu: float, mfu: float = 0.4, world: int = 1) -> dict:
    """Images/s per GPU the training step needs against what the loader gives from ``cpus_per_gpu`` cores.

    The augmentation runs where a CUDA run would put it (``data.augment_on``, auto = the device when it supports
    the recipe); the loader's rate is ``cpus_per_gpu`` x 1000 / its CPU ms per image."""
    from .data.device_augment import augment_on_device

    c = 4 if cfg.parallel.precision == "fp32" else 2
    facts = model_facts(cfg, c)
    global_batch = cfg.data.global_batch_size
    step_s = 3 * facts.fwd_flops_per_image * global_batch / (world * GPUS[gpu].peak_tflops * 1e12 * mfu)
    need = global_batch / world / step_s
    where = "device" if augment_on_device(cfg.data, torch.device("cuda")) else "cpu"
    ms = LOADER_CPU_MS_PER_IMAGE[(cfg.data.format, where)]
    give = cpus_per_gpu * 1000 / ms
    return {"gpu_images_per_s": need, "loader_images_per_s": give, "cpu_ms_per_image": ms, "augment_on": where,
            "format": cfg.data.format, "cpus_per_gpu": cpus_per_gpu, "step_s": step_s,
            "bottleneck": "loader" if give < need else "gpus"}
