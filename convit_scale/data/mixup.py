"""Mixup and CutMix (DeiT's recipe, the paper's Section 3) drawn per canonical group, the same at any world size.

DeiT mixes with timm's ``Mixup(mode="batch")`` on each GPU's batch: one draw per GPU batch (apply or not with
``mixup_prob``, CutMix rather than Mixup with ``mixup_switch_prob``, lambda from Beta(alpha, alpha), CutMix's box and
its area-corrected lambda), each sample mixed with the sample at the mirrored place of the batch (``x.flip(0)``),
targets smoothed one-hot vectors mixed with the same lambda. So what a sample is mixed with, and how, depends on how
many GPUs share the global batch. Here the unit is the canonical group (geometry.py) instead of the GPU batch: the g
samples of group k of a step are mixed as timm mixes a batch of g (sample i with sample g - 1 - i of the group),
with one draw from a generator seeded by (seed, epoch, step, k). The paper's ConViT runs put 64 images on each of 16
GPUs at batch 1024 (DeiT's own 8 x 128 and 16 x 64 layouts alike draw per GPU batch): with the default 16 canonical
groups of 64 a group is such a GPU batch and the draws are distributed as DeiT's, while a run on 1, 2, 4 or 8 GPUs,
or one resumed on another number, makes exactly the same draws.

The draws are made on the host (a few numbers per group); the per-sample weights, lambdas and boxes reach the device
in one asynchronous copy per dtype (``device_augment.to_device``, called by the step), and the mixing is a handful of
batched tensor operations with no host synchronisation.
"""

from __future__ import annotations

import numpy as np
import torch

from ..config import DataConfig
from .order import MIXUP_STREAM, view_seeds


class GroupMixup:
    """timm's Mixup/CutMix (mode "batch", ``correct_lam``, label smoothing) applied per canonical group of
    ``group_size`` samples. ``plan`` draws on the host, ``apply`` mixes on the images' device."""

    def __init__(self, d: DataConfig, num_classes: int, group_size: int, groups: int, seed: int):
        self.mixup_alpha, self.cutmix_alpha = d.mixup, d.cutmix
        self.prob, self.switch_prob, self.smoothing = d.mixup_prob, d.mixup_switch_prob, d.label_smoothing
        self.num_classes, self.group_size, self.groups, self.seed = num_classes, group_size, groups, seed

    def draw(self, rng: np.random.Generator, height: int, width: int) -> tuple[float, tuple | None]:
        """One group's (lambda, CutMix box (yl, yh, xl, xh) or None), drawn as timm's ``_params_per_batch`` and
        ``cutmix_bbox_and_lam`` draw for a batch: lambda 1 when the group is not mixed."""
        if not rng.random() < self.prob:
            return 1.0, None
        if self.mixup_alpha > 0 and self.cutmix_alpha > 0:
            cutmix = bool(rng.random() < self.switch_prob)
        else:
            cutmix = self.cutmix_alpha > 0
        lam = float(rng.beta(*(2 * [self.cutmix_alpha if cutmix else self.mixup_alpha])))
        if not cutmix:
            return lam, None
        ratio = np.sqrt(1 - lam)
        cut_h, cut_w = int(height * ratio), int(width * ratio)
        cy, cx = int(rng.integers(0, height)), int(rng.integers(0, width))
        yl, yh = np.clip(cy - cut_h // 2, 0, height), np.clip(cy + (cut_h + 1) // 2, 0, height)
        xl, xh = np.clip(cx - cut_w // 2, 0, width), np.clip(cx + (cut_w + 1) // 2, 0, width)
        box = (int(yl), int(yh), int(xl), int(xh))
        return 1.0 - (box[1] - box[0]) * (box[3] - box[2]) / float(height * width), box

    def plan(self, epoch: int, step: int, first_group: int, count: int, height: int, width: int) -> list[torch.Tensor]:
        """The host tensors of groups [first_group, first_group + count) of ``step``, per sample: the weight of the
        sample's own image and of its partner's outside a CutMix box, float32 (n,) each; the target's lambda and
        1 - lambda, float32 (n,) each (timm computes them in float64 and rounds once); the box, int64 (n, 4)
        (empty where the group is not cut)."""
        g, n = self.group_size, count * self.group_size
        own, partner, lam, box = np.ones(n), np.zeros(n), np.ones(n), np.zeros((n, 4), dtype=np.int64)
        seeds = view_seeds(self.seed, epoch, step * self.groups + first_group + np.arange(count), stream=MIXUP_STREAM)
        for j, group_seed in enumerate(seeds.tolist()):
            value, cut = self.draw(np.random.default_rng(group_seed), height, width)
            rows = slice(j * g, (j + 1) * g)
            lam[rows] = value
            if cut is None:  # Mixup (or none: lambda 1) over the whole image
                own[rows], partner[rows] = value, 1.0 - value
            else:  # CutMix: the partner's pixels inside the box, the sample's own outside
                box[rows] = cut
        as32 = [torch.from_numpy(a.astype(np.float32)) for a in (own, partner, lam, 1.0 - lam)]
        return as32 + [torch.from_numpy(box)]

    def apply(self, x: torch.Tensor, y: torch.Tensor, plan: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        """(mixed images, soft targets (n, classes) float32) of a micro-batch of whole groups; ``plan`` is ``plan``'s
        tensors on x's device."""
        own, partner, lam, lam_partner, box = plan
        n, _, h, w = x.shape
        i = torch.arange(n, device=x.device)
        mirror = i + (self.group_size - 1) - 2 * (i % self.group_size)  # sample g-1-j of the group pairs with j
        top, bottom, left, right = box.view(n, 4, 1, 1).unbind(1)
        rows = torch.arange(h, device=x.device).view(1, h, 1)
        cols = torch.arange(w, device=x.device).view(1, 1, w)
        inside = ((rows >= top) & (rows < bottom) & (cols >= left) & (cols < right)).unsqueeze(1)  # (n, 1, H, W)
        mixed = x * own.to(x.dtype).view(n, 1, 1, 1) + x[mirror] * partner.to(x.dtype).view(n, 1, 1, 1)
        x = torch.where(inside, x[mirror], mixed)
        off = self.smoothing / self.num_classes
        y1 = torch.full((n, self.num_classes), off, device=y.device).scatter_(1, y.long().view(-1, 1),
                                                                            1.0 - self.smoothing + off)
        return x, y1 * lam.view(n, 1) + y1[mirror] * lam_partner.view(n, 1)
