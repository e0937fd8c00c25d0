"""The training loss (the paper's Section 3: DeiT's recipe): cross-entropy with label smoothing, or soft-target
cross-entropy on Mixup/CutMix targets (which carry the smoothing), and, for Table 4, DeiT's distillation term from a
teacher (``distill.py`` loads and checks the teacher).

``build_criterion`` gives ``criterion(images, logits, targets) -> loss``: the images feed the teacher."""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from timm.loss import SoftTargetCrossEntropy
from torch import nn

from ..config import Config, DistillConfig
from .distill import load_teacher

Criterion = Callable[[torch.Tensor, "torch.Tensor | tuple", torch.Tensor], torch.Tensor]


def base_loss(cfg: Config):
    """(logits, targets) -> loss: soft-target cross-entropy with Mixup/CutMix, else cross-entropy with
    ``data.label_smoothing``."""
    if cfg.data.mixup > 0 or cfg.data.cutmix > 0:
        return SoftTargetCrossEntropy()  # targets from Mixup already carry the label smoothing
    return lambda logits, y: F.cross_entropy(logits, y, label_smoothing=cfg.data.label_smoothing)


def build_criterion(cfg: Config, device: torch.device) -> tuple[Criterion, nn.Module | None]:
    """(criterion(images, logits, targets), the teacher or None)."""
    base = base_loss(cfg)
    if not cfg.distill.enabled:
        return (lambda x, logits, y: base(logits, y)), None
    teacher = load_teacher(cfg, device)
    return DistillLoss(base, teacher, cfg.distill, precision=cfg.parallel.precision), teacher


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
