"""Loaders (FFCV, WebDataset, ImageFolder) with one contract, the epoch plan, and the DeiT transforms.

``loader.epoch(epoch, start_batch)`` yields ``Batch`` objects (``x, y = batch``; data/batch.py): images float
(B, 3, S, S), normalised (or, with ``LoaderSpec.augment_on_device``, uint8 crops, for device_augment.py to finish on the
training device); labels int64 (B,); in training each sample's seed and id; ``len(loader)`` batches per epoch, the same
on every rank, of which the first ``loader.num_real`` samples count (``geometry.py``). Train epochs follow the canonical
layout (``geometry.py``): shuffled from the seed with repeated augmentation, whole global batches only, each sample at
the same place of the same step at any world size, its augmentation seeded by that place, so a run resumed on any number
of ranks continues bit-identically (up to the reduction order of the gradients).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Protocol

from ..config import DataConfig
from ..manifest import Manifest
from .batch import Batch
from .faults import DataError
from .geometry import LoaderSpec
from .imagefolder import ImageFolderLoader
from .steps import StepBatches
from .wds import WdsLoader

__all__ = ["Batch", "DataError", "Loader", "LoaderSpec", "build_loader", "Manifest"]


class Loader(Protocol):
    """The contract of every format's loader (ImageFolder, WebDataset, FFCV)."""

    spec: LoaderSpec
    num_samples: int
    """Images in the split (after the subset)."""
    num_real: int
    """Of this rank's views in an epoch, how many count (evaluation pads the ranks to equal length)."""

    def __len__(self) -> int:
        """Batches per epoch, the same on every rank (train: steps x ``spec.accum``)."""

    def epoch(self, epoch: int, start_batch: int = 0) -> Iterator[Batch]:
        """The batches of ``epoch`` from ``start_batch`` on; closing the generator ends the epoch's workers."""


def build_loader(d: DataConfig, spec: LoaderSpec) -> Loader:
    """The loader of ``data.format`` for one split on one rank; in training, where this rank's micro-batches are not
    all of ``micro_batch_size`` samples (unequal shares of the canonical groups), the format loader reads one group a
    batch and ``StepBatches`` assembles the step's micro-batches."""
    if not spec.whole_micro_batches:
        return StepBatches(_format_loader(d, spec.per_group()), spec)
    return _format_loader(d, spec)


def _format_loader(d: DataConfig, spec: LoaderSpec) -> Loader:
    if d.format == "imagefolder":
        return ImageFolderLoader(d, spec)
    if d.format == "wds":
        return WdsLoader(d, spec)
    from .ffcv import FfcvLoader  # ffcv (and numba) only when asked for

    return FfcvLoader(d, spec)
