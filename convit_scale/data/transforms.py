"""The DeiT recipe's transforms (the paper's Section 3), built with timm so every loader shares them.

Train: bicubic RandomResizedCrop + flip, RandAugment rand-m9-mstd0.5-inc1, colour jitter 0.4 (timm skips
it when RandAugment is on, as DeiT does), normalisation, random erasing 0.25 in pixel mode.
Eval: resize to img_size / 0.875 (256 for 224), centre crop, normalisation.
Mixup 0.8 / CutMix 1.0 with label smoothing act on the canonical groups of a batch in the training step (mixup.py).

With the augmentation on the training device (``LoaderSpec.augment_on_device``) the loaders stop at uint8
tensors: train after the crop and flip, eval after the resize and centre crop; device_augment.py does the rest.
"""

from __future__ import annotations

import random

import numpy as np
import torch
from timm.data import IMAGENET_DEFAULT_MEAN, IMAGENET_DEFAULT_STD, create_transform
from timm.data.transforms import MaybePILToTensor
from torchvision.transforms import Compose

from ..config import DataConfig


def build_train_transform(d: DataConfig, img_size: int, on_device: bool = False):
    """The whole train transform, or (``on_device``) its crop and flip only, to a uint8 (3, S, S) tensor."""
    if on_device:
        primary, _, _ = create_transform(input_size=img_size, is_training=True, scale=tuple(d.crop_scale),
                                         hflip=d.hflip, interpolation=d.interpolation, separate=True)
        return Compose([*primary.transforms, MaybePILToTensor()])
    return create_transform(
        input_size=img_size, is_training=True, scale=tuple(d.crop_scale), hflip=d.hflip,
        color_jitter=d.color_jitter, auto_augment=d.rand_augment, interpolation=d.interpolation,
        re_prob=d.reprob, re_mode="pixel", re_count=1,
    )


def build_eval_transform(d: DataConfig, img_size: int, on_device: bool = False):
    """Resize, centre crop, normalise; or (``on_device``) a uint8 (3, S, S) tensor, normalised on the device."""
    return create_transform(input_size=img_size, is_training=False, interpolation=d.interpolation,
                            crop_pct=d.eval_crop_ratio, use_prefetcher=on_device)


def seed_host(seed: int) -> None:
    """Seed Python, NumPy and torch's CPU generator: what timm's per-sample transforms draw from. The loaders call
    it once per sample; ``torch.manual_seed`` would also reseed every accelerator (each call formats a stack trace
    for the lazily initialised ones, ~50x the cost), and in a loader on the training thread it would reset the
    generator that drop-path draws from on the GPU."""
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.default_generator.manual_seed(seed)


def seed_all(seed: int) -> None:
    """Seed Python, NumPy and torch on every device (the training step seeds them with its own seed, the same on every
    rank: its Mixup and drop-path draw from the groups' and samples' seeds, nothing of it from these)."""
    seed_host(seed)
    torch.manual_seed(seed)


MEAN, STD = IMAGENET_DEFAULT_MEAN, IMAGENET_DEFAULT_STD
