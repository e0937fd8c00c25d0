"""Loaders (FFCV, WebDataset, ImageFolder) with one contract, the epoch plan, and the DeiT transforms.

``loader.epoch(epoch, start_batch)`` yields ``Batch`` objects (``x, y = batch``; data/batch.py): images float
(B, 3, S, S), normalised (or, with ``LoaderSpec.augment_on_device``, uint8 crops, for device_augment.py to finish on the
training device); labels int64 (B,); in training each sample's seed and id; ``len(loader)`` batches per epoch, the same
on every rank, of which the first ``loader.num_real`` samples count (``geometry.py``). Train epochs follow the canonical
layout (``geometry.py``): shuffled from the seed with repeated augmentation, whole global batches only, each sample at
the same place of the same step at any world size, its augmentation seeded by that place, so a run resumed on any number
of ranks continues bit-identically (up to the reduction order of the gradients).

Where each stage of DeiT's augmentation runs, by format and ``data.augment_on`` (``cpu``: in the loader; ``device``:
on the training device; ``auto`` is resolved by ``device_augment.augment_on_device``). The loader's
draws are seeded per view (``order.view_seeds``), the device's from the same seeds (``Batch.seeds``):

| stage (train)      | on     | ffcv                           | wds                            | imagefolder         |
| ------------------ | ------ | ------------------------------ | ------------------------------ | ------------------- |
| decode             | both   | ffcv_decoders.py: the crop box | transforms.py: the crop box    | imagefolder.py:     |
|                    |        | only (jpeg.py decode_rgb_box   | only (jpeg_roi.py; the JPEG    | PIL, the whole      |
|                    |        | -> jpeg_roi.py)                | opened by faults.py            | image               |
|                    |        |                                | open_jpeg_or_decode)           |                     |
| RandomResizedCrop, | both   | ffcv_decoders.py               | transforms.py: timm's, its     | transforms.py:      |
| flip               |        | SeededCropFlipDecoder          | crop CropDecodingResizedCrop   | timm's              |
|                    |        | (resample.py,                  |                                |                     |
|                    |        | splitmix_numba.py)             |                                |                     |
| RandAugment        | cpu    | private_aug.py, run by         | transforms.py: timm's          | transforms.py:      |
| (colour jitter     |        | ffcv_decoders.py               |                                | timm's              |
| without it)        |        | PrivateTimmStage               |                                |                     |
| normalize          | cpu    | as RandAugment                 | transforms.py: timm's          | transforms.py:      |
|                    |        |                                |                                | timm's              |
| random erasing     | cpu    | as RandAugment                 | transforms.py: timm's          | transforms.py:      |
|                    |        |                                |                                | timm's              |
| RandAugment,       | device | device_augment.py augment_batch, called by train/step.py, the policy parsed by        |
| normalize, erasing |        | augment_policy.py (colour jitter: refused by the recipe's check)                      |
| Mixup / CutMix     | both   | mixup.py GroupMixup, per canonical group, on the device in train/step.py (after the   |
|                    |        | device augmentation)                                                                  |

With the augmentation on the device, the resize, or the decode and the resize, can move there too
(``data.resize_on``, ``data.decode_on``; ``LoaderSpec.handover``): the train loaders then hand over the crop boxes at
their own size (``batch.Boxes``) or the views undecoded (``batch.Encoded``), and ``device_images.py`` finishes them
on the training device. Which views, their seeds, crop boxes and flips are the same in every format and mode
(``sample.py``).

Evaluation: the resize and centre crop in ffcv_decoders.py ``TimmEvalDecoder`` (ffcv; resample.py) or timm's eval
transform (transforms.py ``build_eval_transform``: wds, imagefolder); normalisation there too (ffcv_decoders.py
``EvalNormalize`` for ffcv), or, with ``augment_on: device``, device_augment.py ``normalize`` called by
evaluation.py. The wds and imagefolder transforms draw from the global generators, seeded per view by
transforms.py ``seed_host``; ffcv's from the view's seed (``splitmix_numba``, ``private_aug``'s private generators).
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
