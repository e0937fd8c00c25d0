"""FFCV .beton files through ffcv's Loader, with the epoch plan as its traversal order.

This module imports ffcv; ``build_loader`` imports it only for ``data.format: ffcv``. Differences from
timm, by FFCV's design: the crop is decoded and resized in one step with OpenCV's INTER_AREA (not
bicubic), and eval crops the centre square (ratio 0.875) before resizing rather than resizing to 256
first (same geometry). RandAugment, normalisation and random erasing are timm's.
"""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import torch
from ffcv.fields.basics import IntDecoder
from ffcv.fields.rgb_image import CenterCropRGBImageDecoder, RandomResizedCropRGBImageDecoder
from ffcv.loader import Loader
from ffcv.loader.loader import ORDER_MAP
from ffcv.transforms import RandomHorizontalFlip, Squeeze, ToTensor, ToTorchImage
from ffcv.traversal_order.base import TraversalOrder
from PIL import Image

from ..config import DataConfig
from .geometry import DataError, EpochGeometry, LoaderSpec
from .plan import sample_seed
from .transforms import MEAN, STD, seed_all
from .wds import read_manifest


class PlanOrder(TraversalOrder):
    """The epoch plan as ffcv's traversal order. ffcv asks for ``sample_order(epoch)`` with its own epoch
    counter; the epoch and the resume position are the plan's, so FfcvLoader puts the order of the next
    iteration on the ffcv Loader (``plan_order``) before iterating it. ffcv's constructor asks once, to
    size its ``len()``: then it gets the whole subset, which is never shorter than a rank's epoch."""

    def sample_order(self, epoch: int) -> np.ndarray:
        return getattr(self.loader, "plan_order", self.indices)


ORDER_KEY = "convit_scale_plan"
ORDER_MAP[ORDER_KEY] = PlanOrder  # ffcv refuses an order class that is not registered


def subset_indices(location: Path, manifest: dict, split: str, fraction: float) -> tuple[str, np.ndarray]:
    """The .beton of ``split`` and the file indices of its Table 2 subset (the first files of each class:
    files are written in sorted (class, file) order)."""
    if split not in manifest.get("splits", {}):
        raise DataError(f"{location}: manifest has no {split!r} split")
    info = manifest["splits"][split]
    (name,) = info["files"]
    counts = [info["per_class"].get(str(c), 0) for c in range(len(manifest["classes"]))]
    starts = np.cumsum([0] + counts)
    return name, np.concatenate([np.arange(s, s + math.floor(c * fraction)) for s, c in zip(starts, counts)])


class _TimmAfterFfcv(torch.nn.Module):
    """Per-image timm RandAugment + normalise + random erasing after FFCV's crop/flip (uint8 batch in)."""

    def __init__(self, secondary, final, seed_fn):
        super().__init__()
        self.secondary, self.final, self.seed_fn = secondary, final, seed_fn
        self.calls = 0

    def forward(self, batch: torch.Tensor) -> torch.Tensor:  # (B, 3, S, S) uint8
        seed_all(self.seed_fn(self.calls))
        self.calls += 1
        out = []
        for img in batch:
            pil = Image.fromarray(img.permute(1, 2, 0).numpy())
            out.append(self.final(self.secondary(pil)))
        return torch.stack(out)


class _EvalNormalize(torch.nn.Module):
    def forward(self, batch: torch.Tensor) -> torch.Tensor:
        mean = torch.tensor(MEAN).view(1, 3, 1, 1) * 255
        std = torch.tensor(STD).view(1, 3, 1, 1) * 255
        return (batch.float() - mean) / std


class FfcvLoader:
    """FFCV .beton through ffcv's Loader with the epoch plan as its traversal order."""

    def __init__(self, d: DataConfig, spec: LoaderSpec):
        location = Path(d.train_path if spec.train else d.val_path)
        manifest = read_manifest(str(location))
        name, indices = subset_indices(location, manifest, spec.split, d.subset_fraction if spec.train else 1.0)
        self.num_samples = len(indices)
        self.d, self.spec = d, spec
        self.geometry = EpochGeometry.of(self.num_samples, spec, str(location))
        self.num_real = self.geometry.num_real
        self._indices = indices
        self._epoch, self._start = 0, 0
        b, size = spec.micro_batch_size, spec.img_size
        if spec.train:
            from timm.data import create_transform

            _, secondary, final = create_transform(
                input_size=size, is_training=True, hflip=0.0, color_jitter=d.color_jitter,
                auto_augment=d.rand_augment, interpolation=d.interpolation, re_prob=d.reprob,
                re_mode="pixel", re_count=1, separate=True)
            image_pipe = [RandomResizedCropRGBImageDecoder((size, size), scale=(0.08, 1.0)),
                          RandomHorizontalFlip(d.hflip), ToTensor(), ToTorchImage(channels_last=False),
                          _TimmAfterFfcv(secondary, final, lambda k: sample_seed(spec.seed, self._epoch,
                                                                                 spec.rank, self._start + k))]
        else:
            image_pipe = [CenterCropRGBImageDecoder((size, size), ratio=d.eval_crop_ratio), ToTensor(),
                          ToTorchImage(channels_last=False), _EvalNormalize()]
        self._make = lambda: Loader(
            str(location / name), batch_size=b, num_workers=max(1, d.num_workers), order=ORDER_KEY,
            indices=indices, seed=spec.seed, drop_last=spec.train, os_cache=True,
            pipelines={"image": image_pipe, "label": [IntDecoder(), ToTensor(), Squeeze()]},
        )
        self._image_pipe = image_pipe
        self._loader = None  # built once: each ffcv Loader compiles its pipeline with numba (seconds)

    def __len__(self) -> int:
        return self.geometry.num_batches

    def epoch(self, epoch: int, start_batch: int = 0):
        self._epoch, self._start = epoch, start_batch
        if isinstance(self._image_pipe[-1], _TimmAfterFfcv):
            self._image_pipe[-1].calls = 0
        if self._loader is None:
            self._loader = self._make()
        b = self.spec.micro_batch_size
        positions = self.geometry.sample_indices(epoch, self.d.repeated_aug)[start_batch * b:]
        self._loader.plan_order = self._indices[positions]
        for images, labels in self._loader:
            # ffcv reuses its output buffers: copy what leaves the loader.
            yield images.clone(), labels.clone().long()
