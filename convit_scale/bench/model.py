"""`bench model`: training throughput and peak memory of our ConViT against timm's, and of ConViT against DeiT."""

from __future__ import annotations

import timm
import torch

from ..models import create_model
from .worker import Workload, run_worker, timed_step

CANDIDATES = {  # key: (model, GPSA implementation); "timm:" models are timm's own
    "ours_fast": ("convit_small", "fast"),
    "ours_reference": ("convit_small", "reference"),
    "timm_convit": ("timm:convit_small", None),
    "timm_deit": ("timm:deit_small_patch16_224", None),
    "ours_deit": ("deit_small", None),
}


def build(spec: dict, device: torch.device) -> Workload:
    """One candidate, forward + backward, gradients kept allocated (no optimizer)."""

    name, impl = spec["model"]
    if name.startswith("timm:"):
        model = timm.create_model(name[5:], drop_path_rate=0.0)
    else:
        model = create_model(name, drop_path_rate=0.0, **({"gpsa_impl": impl} if impl else {}))
    return Workload(model.to(device).train())


def worker(spec: dict) -> dict:
    return timed_step(spec, build)


def bench_model(batch: int, steps: int, rounds: int, device: str, precision: str) -> dict:
    results: dict[str, dict] = {}
    for _ in range(rounds):
        for key, model in CANDIDATES.items():
            spec = {"model": model, "batch": batch, "img_size": 224, "steps": steps, "warmup": 1, "device": device,
                    "precision": precision}
            r = run_worker("model", spec)  # the times: training's malloc
            m = r if device.startswith("cuda") else run_worker("model", spec, memory=True)  # CPU: RSS, a run of its own
            best = results.get(key)
            results[key] = {"images_per_s": max(r["images_per_s"], best["images_per_s"] if best else 0),
                            "peak_mb": min(m["peak_mb"], best["peak_mb"] if best else float("inf"))}
    ref = results["timm_convit"]
    for r in results.values():
        r["throughput_vs_timm_convit"] = r["images_per_s"] / ref["images_per_s"]
        r["memory_vs_timm_convit"] = r["peak_mb"] / ref["peak_mb"]
    ratios = {
        "convit_vs_deit_ours": results["ours_fast"]["images_per_s"] / results["ours_deit"]["images_per_s"],
        "convit_vs_deit_timm": results["timm_convit"]["images_per_s"] / results["timm_deit"]["images_per_s"],
        "ours_convit_vs_timm_deit": results["ours_fast"]["images_per_s"] / results["timm_deit"]["images_per_s"],
    }
    return {"batch": batch, "steps": steps, "rounds": rounds, "device": device, "precision": precision,
            "results": results, "ratios": ratios}
