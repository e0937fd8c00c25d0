"""`bench inference`: Table 1's speed column, images/s at inference, ConViT beside DeiT at each size in one run.

The paper's setting (Table 1): batch 128, 224 x 224, fp32, one GPU (a Quadro GP100). Each model runs in a fresh
subprocess (``worker``), the sizes' DeiT and ConViT one after the other, in interleaved rounds; the best round of
each is kept and each size's ConViT / DeiT ratio is set beside the paper's, the number that carries over from
their GPU to another.
"""

from __future__ import annotations

import torch

from ..errors import BadInput
from ..models import MODELS, create_model
from .worker import run_worker, timed

PAPER_IMAGES_PER_S = {  # Table 1: (DeiT, ConViT) images/s, Quadro GP100, batch 128, fp32 inference
    "tiny": (1442, 734), "tiny_plus": (1036, 625), "small": (587, 305), "small_plus": (480, 382),
    "base": (187, 141), "base_plus": (114, 96),
}
SIZES = tuple(PAPER_IMAGES_PER_S)


def worker(spec: dict) -> dict:
    """Images/s of ``spec["steps"]`` forwards of a batch (no gradients, eval mode) after ``spec["warmup"]``."""

    device = torch.device(spec["device"])
    torch.manual_seed(0)
    size = MODELS[spec["model"]].img_size
    model = create_model(spec["model"], drop_path_rate=0.0).to(device).eval()
    x = torch.randn(spec["batch"], 3, size, size, device=device)
    dtype = torch.bfloat16 if spec["precision"] == "bf16" else None

    def step():
        with torch.inference_mode(), torch.autocast(device.type, dtype=dtype, enabled=dtype is not None):
            model(x)

    for _ in range(spec["warmup"]):
        step()
    seconds = timed(step, spec["steps"], device)
    return {"images_per_s": spec["batch"] * spec["steps"] / seconds, "img_size": size}


def bench_inference(sizes: list[str], batch: int, steps: int, warmup: int, rounds: int, device: str,
                    precision: str) -> dict:
    unknown = sorted(set(sizes) - set(SIZES))
    if unknown:
        raise BadInput(f"bench inference --sizes {','.join(unknown)}: allowed: {', '.join(SIZES)}")
    best: dict[str, float] = {}
    for _ in range(rounds):
        for size in sizes:
            for family in ("deit", "convit"):
                name = f"{family}_{size}"
                r = run_worker("inference", {"model": name, "batch": batch, "steps": steps, "warmup": warmup,
                                             "device": device, "precision": precision})
                best[name] = max(best.get(name, 0.0), r["images_per_s"])
    rows = {}
    for size in sizes:
        deit, convit = best[f"deit_{size}"], best[f"convit_{size}"]
        paper_deit, paper_convit = PAPER_IMAGES_PER_S[size]
        rows[size] = {"deit_images_per_s": deit, "convit_images_per_s": convit, "convit_vs_deit": convit / deit,
                      "paper_deit": paper_deit, "paper_convit": paper_convit,
                      "paper_convit_vs_deit": paper_convit / paper_deit}
    on_gpu = device.startswith("cuda") and torch.cuda.is_available()
    return {"device": device, "device_name": torch.cuda.get_device_name(torch.device(device)) if on_gpu else "cpu",
            "precision": precision, "batch": batch, "steps": steps, "warmup": warmup, "rounds": rounds,
            "results": rows}
