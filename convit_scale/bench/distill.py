"""`bench distill`: the cost of DeiT's hard distillation, the teacher's forward on every student step."""

from __future__ import annotations

import timm
import torch
import torch.nn.functional as F

from ..config import DistillConfig
from ..models import MODELS, create_model
from ..train.loss import DistillLoss
from .worker import Workload, run_worker, timed_step

STUDENT, TEACHER = "convit_small_plus", "regnety_160"  # Table 4: ConViT-S+ taught by RegNetY-16GF


def build(spec: dict, device: torch.device) -> Workload:
    """The student; with a teacher (a timm model), the training loop's own ``DistillLoss`` (hard, alpha 0.5)."""

    student = create_model(spec["student"], drop_path_rate=0.0).to(device).train()
    if not spec["teacher"]:
        return Workload(student)
    teacher = timm.create_model(spec["teacher"]).to(device).eval().requires_grad_(False)
    return Workload(student, loss=DistillLoss(F.cross_entropy, teacher, DistillConfig(type="hard", alpha=0.5)))


def worker(spec: dict) -> dict:
    return timed_step(spec, build)


def bench_distill(batch: int, steps: int, rounds: int, device: str, student: str = STUDENT,
                  teacher: str = TEACHER) -> dict:
    """Student step images/s with and without the teacher's forward (no grad), same inputs, fp32."""

    best: dict[str, float] = {}
    for _ in range(rounds):
        for t in (None, teacher):
            r = run_worker("distill", {"student": student, "teacher": t, "batch": batch,
                                       "img_size": MODELS[student].img_size, "steps": steps, "warmup": 1,
                                       "device": device, "precision": "fp32"})
            key = t or "student_only"
            best[key] = max(best.get(key, 0.0), r["images_per_s"])
    return {"batch": batch, "results": best, "ratio_with_teacher": best[teacher] / best["student_only"]}
