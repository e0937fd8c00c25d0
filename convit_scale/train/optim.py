"""AdamW with explicit parameter groups (the DeiT recipe the paper trains with, Section 4)."""

from __future__ import annotations

import torch
from torch import nn

from ..config import OptimConfig


def param_groups(model: nn.Module, weight_decay: float) -> list[dict]:
    """Weight decay on weight matrices only: not on biases and norms (1-D), nor on the position
    embedding, class/distillation tokens and gating parameters (``model.no_weight_decay()``).

    Names are matched exactly (no substring rules); frozen parameters are left out.
    """
    skip = set(getattr(model, "no_weight_decay", lambda: set())())
    decay, no_decay = [], []
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        (no_decay if p.ndim <= 1 or name in skip else decay).append(p)
    return [{"params": decay, "weight_decay": weight_decay, "group": "decay"},
            {"params": no_decay, "weight_decay": 0.0, "group": "no_decay"}]


def build_optimizer(model: nn.Module, o: OptimConfig, lr: float, device: torch.device) -> torch.optim.AdamW:
    """AdamW over the groups of :func:`param_groups`. On CUDA the fused kernel (one launch for all parameters,
    FSDP2's DTensors and DeepSpeed's flat partitions included); elsewhere the multi-tensor (foreach) kernels: torch
    picks them by itself for CUDA tensors only, and on CPU its per-parameter loop dispatches each of a dozen ops
    once per FSDP2 DTensor, 15% of a small model's step. ``optim.fused`` chooses either anywhere (the fused kernel
    keeps ``step`` on the parameters' device, where a restored state must put it)."""
    groups = [{k: v for k, v in g.items() if k != "group"} for g in param_groups(model, o.weight_decay)]
    fused = device.type == "cuda" if o.fused is None else o.fused
    return torch.optim.AdamW(groups, lr=lr, betas=o.betas, eps=o.eps, fused=fused or None, foreach=not fused)
