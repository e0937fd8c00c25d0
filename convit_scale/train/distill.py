"""DeiT's hard (and soft) distillation from a teacher of any timm architecture (Table 4).

The teacher runs in eval mode without gradients (bf16 on GPUs) on the same augmented batch as the
student, replicated on every rank: it is never wrapped by FSDP2/ZeRO, never in the optimizer, never in
the student's checkpoint. Its weights come from a local file, checked key by key before training.
"""

from __future__ import annotations

import functools
import hashlib
import math
import re
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from ..config import Config, DistillConfig
from ..evaluation import evaluate
from ..models.weights import load_timm_model


HUB_NAME = re.compile(r"^.+-([0-9a-f]{8,64})\.(?:pth|pt|bin|safetensors)$")
"""torch.hub's naming of published weights: the file name ends with a prefix of its SHA-256 (DeiT's teacher is
regnety_160-a5fe301d.pth)."""


@functools.lru_cache(maxsize=8)
def _sha256(path: str, size: int, mtime: float) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 22), b""):
            h.update(block)
    return h.hexdigest()


def check_hash_prefix(path: str | Path) -> None:
    """A file named like torch.hub's published weights must match the SHA-256 prefix in its name."""
    path = Path(path)
    match = HUB_NAME.match(path.name)
    if match is None or not path.is_file():
        return
    st = path.stat()
    digest = _sha256(str(path), st.st_size, st.st_mtime)
    if not digest.startswith(match.group(1)):
        raise ValueError(f"distill.teacher_checkpoint {path}: its SHA-256 starts with {digest[:len(match.group(1))]}, "
                         f"not {match.group(1)} as its name says: the file is corrupt or another one; download it again")


def build_teacher(cfg: Config) -> nn.Module:
    """The teacher with its weights, on CPU, checked key by key (raises with the list of keys) and against the
    SHA-256 prefix its name carries."""
    d = cfg.distill
    check_hash_prefix(d.teacher_checkpoint)
    teacher = load_timm_model(d.teacher_model, d.teacher_checkpoint, num_classes=cfg.model.num_classes,
                              what=f"distill.teacher_checkpoint {d.teacher_checkpoint}",
                              name_key="distill.teacher_model")
    teacher.eval().requires_grad_(False)
    return teacher


def load_teacher(cfg: Config, device: torch.device) -> nn.Module:
    teacher = build_teacher(cfg).to(device)
    if device.type == "cuda" and cfg.parallel.precision != "fp32":
        teacher = teacher.to(torch.bfloat16)
    return teacher


class DistillLoss:
    """(1 - alpha) x base(student, mixed labels) + alpha x distillation term.

    hard: CE(student, argmax teacher(x)); soft: KL at temperature tau (DeiT's formula).
    With a distillation token the student returns (class logits, distillation logits): the first
    learns from the labels, the second from the teacher.
    """

    def __init__(self, base, teacher: nn.Module, d: DistillConfig, precision: str = "fp32"):
        self.base, self.teacher, self.d, self.precision = base, teacher, d, precision

    @torch.no_grad()
    def teacher_logits(self, x: torch.Tensor) -> torch.Tensor:
        self.teacher.eval()  # never in train mode, whatever the caller does
        dtype = next(self.teacher.parameters()).dtype
        return self.teacher(x.to(dtype)).float()

    def __call__(self, x: torch.Tensor, logits, target: torch.Tensor) -> torch.Tensor:
        cls_logits, dist_logits = logits if isinstance(logits, tuple) else (logits, logits)
        t = self.teacher_logits(x)
        base = self.base(cls_logits, target)
        if self.d.type == "hard":
            dist = F.cross_entropy(dist_logits, t.argmax(dim=1))
        else:
            tau = self.d.tau
            dist = F.kl_div(F.log_softmax(dist_logits / tau, dim=1), F.log_softmax(t / tau, dim=1),
                            reduction="sum", log_target=True) * (tau * tau) / dist_logits.numel()
        return (1 - self.d.alpha) * base + self.d.alpha * dist


def check_teacher(teacher: nn.Module, cfg: Config, loader, ctx, images: int = 1000) -> None:
    """``distill.teacher_min_top1``: the teacher's top-1 on up to ``images`` validation images, sharded over the
    ranks on the training device, before any training step."""
    d = cfg.distill
    if d.teacher_min_top1 is None:
        return
    if loader is None:
        raise ValueError("distill.teacher_min_top1 needs validation data (data.val_path) to evaluate the teacher")
    per_rank = math.ceil(images / (ctx.world_size * cfg.data.eval_batch_size))
    teacher.eval()
    dtype = next(teacher.parameters()).dtype
    found = evaluate(lambda x: teacher(x.to(dtype)), loader, ctx.device, max_batches=per_rank)
    if ctx.is_main:
        print(f"[convit-scale] teacher {d.teacher_checkpoint}: top-1 {found['top1']:.2f} on {found['samples']} "
              f"validation images (distill.teacher_min_top1 = {d.teacher_min_top1:g})", flush=True)
    if found["top1"] < d.teacher_min_top1:
        raise ValueError(f"distill.teacher_checkpoint {d.teacher_checkpoint}: the teacher reaches {found['top1']:.2f}% "
                         f"top-1 on {found['samples']} validation images, below distill.teacher_min_top1 = "
                         f"{d.teacher_min_top1:g}: wrong file or wrong architecture (Table 4 uses DeiT's "
                         f"regnety_160-a5fe301d.pth, 82.9%)")
