"""timm's train augmentation after the crop, drawing from per-view private generators.

FFCV runs the augmentation that follows its crop in its own thread. timm's RandAugment and random
erasing (and torchvision's colour jitter) draw from the global ``random``, NumPy and torch generators,
which the training thread seeds every step: two threads drawing from them race, and a run is no longer
reproducible. Here the same timm code runs against a thread's own generators, seeded per view exactly
as ``seed_host(seed)`` seeds the global ones, so ``PrivateAugment(...)(img, seed)`` equals timm's transform
after ``seed_host(seed)`` and no global generator is touched.

The thread's generators reach timm's functions through rebuilt copies of them (same code, a namespace in
which ``random`` is the thread's generator); the classes' own draws (RandAugment's choice of ops, the
colour jitter's parameters) are written out here with the same calls in the same order.
"""

from __future__ import annotations

import functools
import random
import threading
import types

import numpy as np
import torch
import torchvision.transforms.functional as TF
from timm.data import auto_augment, random_erasing
from timm.data import transforms as timm_transforms
from torchvision import transforms as tvt

_local = threading.local()


class _ThreadRandom:
    """Stands for the ``random`` module inside the rebuilt timm functions: the calling thread's generator."""

    def __getattr__(self, name):
        return getattr(_local.py, name)


def _rebuild(module) -> dict:
    """A namespace holding copies of ``module``'s functions whose ``random`` is the thread's generator."""
    ns = dict(vars(module), random=_ThreadRandom())
    for name, obj in vars(module).items():
        if isinstance(obj, types.FunctionType) and obj.__module__ == module.__name__:
            ns[name] = types.FunctionType(obj.__code__, ns, obj.__name__, obj.__defaults__, obj.__closure__)
    return ns


def _rebound(fn, ns: dict):
    if fn is None:
        return None
    if isinstance(fn, functools.partial):
        return functools.partial(_rebound(fn.func, ns), *fn.args, **fn.keywords)
    return ns[fn.__name__]


def _private_get_pixels(per_pixel, rand_color, patch_size, dtype=torch.float32, device="cpu"):
    """timm's ``_get_pixels`` drawing from the thread's torch generator."""
    if per_pixel:
        return torch.empty(patch_size, dtype=dtype, device=device).normal_(generator=_local.torch)
    if rand_color:
        return torch.empty((patch_size[0], 1, 1), dtype=dtype, device=device).normal_(generator=_local.torch)
    return torch.zeros((patch_size[0], 1, 1), dtype=dtype, device=device)


_AA = _rebuild(auto_augment)
_RE = _rebuild(random_erasing)
_RE["_get_pixels"] = _private_get_pixels
_augment_op_call = types.FunctionType(auto_augment.AugmentOp.__call__.__code__, _AA)
_erase = types.FunctionType(random_erasing.RandomErasing._erase.__code__, _RE)


def _rand_augment(ra: auto_augment.RandAugment, ops: list, img):
    """timm's ``RandAugment.__call__`` with the thread's NumPy generator; ``ops`` its ops, rebuilt."""
    chosen = _local.np.choice(len(ops), ra.num_layers, replace=ra.choice_weights is None, p=ra.choice_weights)
    for i in chosen:
        img = _augment_op_call(ops[i], img)
    return img


def _color_jitter(cj: tvt.ColorJitter, img):
    """torchvision's ``ColorJitter.forward`` (its ``get_params`` draws, in order) with the thread's torch generator."""
    g = _local.torch
    fn_idx = torch.randperm(4, generator=g)
    factors = [None if r is None else float(torch.empty(1).uniform_(r[0], r[1], generator=g))
               for r in (cj.brightness, cj.contrast, cj.saturation, cj.hue)]
    adjust = (TF.adjust_brightness, TF.adjust_contrast, TF.adjust_saturation, TF.adjust_hue)
    for fn_id in fn_idx.tolist():
        if factors[fn_id] is not None:
            img = adjust[fn_id](img, factors[fn_id])
    return img


_DETERMINISTIC = (tvt.ToTensor, tvt.PILToTensor, tvt.Normalize, timm_transforms.MaybeToTensor,
                  timm_transforms.MaybePILToTensor)


class PrivateAugment:
    """timm's ``secondary`` (RandAugment or colour jitter) and ``final`` (to tensor, normalise, random
    erasing) transforms of ``create_transform(..., separate=True)``, run with per-view generators."""

    def __init__(self, secondary, final):
        self.steps = [self._private(t) for t in list(secondary.transforms) + list(final.transforms)]

    @staticmethod
    def _private(t):
        if isinstance(t, auto_augment.RandAugment):
            ops = []
            for op in t.ops:
                op = types.SimpleNamespace(**vars(op))
                op.aug_fn, op.level_fn = _rebound(op.aug_fn, _AA), _rebound(op.level_fn, _AA)
                ops.append(op)
            return functools.partial(_rand_augment, t, ops)
        if isinstance(t, tvt.ColorJitter):
            return functools.partial(_color_jitter, t)
        if isinstance(t, random_erasing.RandomErasing):
            def erase(img, t=t):
                if img.dim() != 3:
                    raise ValueError(f"random erasing here takes one (C, H, W) image, got shape {tuple(img.shape)}")
                _erase(t, img, *img.size(), img.dtype)
                return img
            return erase
        if isinstance(t, _DETERMINISTIC):
            return t
        raise ValueError(f"{type(t).__name__}: no private-generator version of this transform "
                         f"(FFCV train augmentation)")

    def __call__(self, img, seed: int):
        """``img`` a PIL image; the steps draw as timm's would after ``seed_host(seed)``."""
        _local.py = random.Random(seed)
        _local.np = np.random.RandomState(seed % 2**32)
        _local.torch = torch.Generator().manual_seed(seed)
        for step in self.steps:
            img = step(img)
        return img
