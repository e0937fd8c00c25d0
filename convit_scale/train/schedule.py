"""Learning-rate schedule: a pure function of the optimizer step (DeiT's recipe, the paper's Section 3)."""

from __future__ import annotations

import math

from ..config import ScheduleConfig


def lr_at(step: int, peak_lr: float, steps_per_epoch: int, s: ScheduleConfig) -> float:
    """Per-step linear warmup from ``warmup_lr`` to ``peak_lr``, then cosine to ``min_lr`` at the end."""
    warmup_steps = round(s.warmup_epochs * steps_per_epoch)
    total_steps = s.epochs * steps_per_epoch
    # 1) linear warmup for warmup_steps
    if step < warmup_steps:
        return s.warmup_lr + (peak_lr - s.warmup_lr) * step / warmup_steps
    # 2) after the schedule, stay at the floor
    if step >= total_steps:
        return s.min_lr
    # 3) in between, cosine decay down to min_lr
    progress = (step - warmup_steps) / max(1, total_steps - warmup_steps)
    return s.min_lr + 0.5 * (peak_lr - s.min_lr) * (1.0 + math.cos(math.pi * progress))


def peak_lr(base_lr: float, global_batch_size: int, reference_batch: int = 512) -> float:
    """DeiT's linear scaling rule: lr = base_lr * global_batch / 512."""
    return base_lr * global_batch_size / reference_batch
