"""`bench mfu`: one device, a full training step (AdamW), model FLOPs against the device's peak."""

from __future__ import annotations

import torch

from ..hardware import peak_tflops_of
from ..models import MODELS, create_model, forward_flops
from .worker import Workload, run_worker, timed_step


def device_peak_tflops(device: str) -> float | None:
    """The dense bf16 peak of a known GPU (``hardware.GPUS``); None on CPU or for an unknown GPU."""
    if not device.startswith("cuda") or not torch.cuda.is_available():
        return None
    return peak_tflops_of(torch.cuda.get_device_name(torch.device(device)))


def build(spec: dict, device: torch.device) -> Workload:
    """A real training step of one model: forward, backward, AdamW step, zero_grad (blocks compiled if asked)."""

    model = create_model(spec["model"], drop_path_rate=0.0).to(device).train()
    if spec.get("compile"):
        for i, block in enumerate(model.blocks):
            model.blocks[i] = torch.compile(block)
    return Workload(model, torch.optim.AdamW(model.parameters(), lr=1e-4, fused=device.type == "cuda"))


def worker(spec: dict) -> dict:
    return timed_step(spec, build)


def bench_mfu(models: list[str], batch: int, steps: int, warmup: int, device: str, precision: str,
              peak_tflops: float | None, compile_blocks: bool = False) -> dict:
    """Training throughput and model FLOPs utilisation: 3 x forward FLOPs per image (counted, not
    estimated) x images/s, over the device's dense peak."""

    peak = peak_tflops or device_peak_tflops(device)
    rows = {}
    for name in models:
        r = run_worker("train", {"model": name, "batch": batch, "img_size": MODELS[name].img_size, "steps": steps,
                                 "warmup": warmup, "device": device, "precision": precision,
                                 "compile": compile_blocks})
        flops = 3 * forward_flops(name)
        achieved = r["images_per_s"] * flops / 1e12
        rows[name] = {**r, "train_gflops_per_image": flops / 1e9, "achieved_tflops": achieved,
                      "mfu": achieved / peak if peak else None}
    on_gpu = device.startswith("cuda") and torch.cuda.is_available()
    return {"device": device, "device_name": torch.cuda.get_device_name(torch.device(device)) if on_gpu else "cpu",
            "precision": precision, "batch": batch, "steps": steps, "compile": compile_blocks,
            "peak_tflops": peak, "results": rows}
