"""The dry run's batches: what the recipe's loader hands the training step, in the same form (float crops, uint8
crops or crop boxes at their own size, as ``LoaderSpec.handover`` says; page-locked where the real loader pins them),
with random pixels, labels and sample seeds. No dataset is read: a plan is made before the data is on the cluster."""

from __future__ import annotations

import numpy as np
import torch

from ..data import Batch, LoaderSpec
from ..data.batch import Boxes, Encoded
from ..data.steps import StepBatches

BOX_SIDES = (0.3, 1.7)
"""The crop boxes' sides, as fractions of the model's input side: RandomResizedCrop's boxes of ImageNet's photographs
(about 500 x 375) at the default scale (0.08, 1) for a 224 input."""


class SyntheticLoader:
    """The Loader contract (data/__init__.py) for ``steps`` optimizer steps (train) or ``batches`` batches a rank
    (val) of random images."""

    def __init__(self, spec: LoaderSpec, num_classes: int, steps: int = 1, batches: int = 1):
        self.spec, self.num_classes = spec, num_classes
        if spec.train:
            self.num_samples = spec.global_batch * steps
            self.num_real = spec.rank_samples * steps
            self.batches = steps * spec.batches_per_step
        else:
            self.num_samples = spec.micro_batch_size * batches * spec.world_size
            self.num_real = spec.micro_batch_size * batches
            self.batches = batches

    def __len__(self) -> int:
        return self.batches

    def epoch(self, epoch: int, start_batch: int = 0):
        gen = torch.Generator().manual_seed(epoch)
        for i in range(start_batch, self.batches):
            yield self._batch(gen, i)

    def _batch(self, gen: torch.Generator, i: int) -> Batch:
        spec, b, size = self.spec, self.spec.micro_batch_size, self.spec.img_size
        labels = torch.randint(0, self.num_classes, (b,), generator=gen)
        if spec.train and spec.handover == "box":
            images = _boxes(gen, b, size)
        elif spec.train and spec.handover == "jpeg":
            images = _encoded(gen, b, size)
        elif spec.augment_on_device:
            images = torch.randint(0, 256, (b, 3, size, size), dtype=torch.uint8, generator=gen)
        else:
            images = torch.randn(b, 3, size, size, generator=gen)
        seeds = torch.randint(0, 2**62, (b,), generator=gen) if spec.train else None
        batch = Batch(images, labels, seeds, (), list(range(i * b, (i + 1) * b)))
        return batch.pin_memory() if spec.pin_memory else batch


def _sides(gen: torch.Generator, b: int, size: int) -> tuple[list, np.random.Generator]:
    """``b`` crop boxes' (h, w) (``BOX_SIDES``), and a generator for their pixels, from ``gen``."""
    lo, hi = (int(size * f) for f in BOX_SIDES)
    sides = torch.randint(lo, hi + 1, (b, 2), generator=gen).tolist()
    return sides, np.random.default_rng(int(torch.randint(0, 2**31, (1,), generator=gen)))


def _boxes(gen: torch.Generator, b: int, size: int) -> Boxes:
    sides, rng = _sides(gen, b, size)
    return Boxes.of([(rng.integers(0, 256, (h, w, 3), dtype=np.uint8), j % 2 == 0) for j, (h, w) in enumerate(sides)])


def _encoded(gen: torch.Generator, b: int, size: int) -> Encoded:
    """Undecoded views (``decode_on: device``) as images the loader decoded (``Encoded.RAW``): the training step's
    path on the device, its own stream, the crops' copy and the resize on the training stream, all but nvJPEG's
    decode itself, which simulated GPUs cannot run (its full images, about 0.5 MB a view on the device, are not in
    the peak)."""
    sides, rng = _sides(gen, b, size)
    views = []
    for j, (h, w) in enumerate(sides):
        height, width = h + int(rng.integers(0, h + 1)), w + int(rng.integers(0, w + 1))  # the box inside its image
        top, left = int(rng.integers(0, height - h + 1)), int(rng.integers(0, width - w + 1))
        pixels = rng.integers(0, 256, (height, width, 3), dtype=np.uint8)
        views.append((pixels, Encoded.RAW, (height, width), (top, left, h, w), j % 2 == 0))
    return Encoded.of(views)


def loaders(num_classes: int, steps: int, eval_batches: int = 1):
    """The ``build`` of ``train.setup``: a split's synthetic loader, assembled as ``data.build_loader`` does."""

    def build(d, spec: LoaderSpec):
        if spec.train and not spec.whole_micro_batches:
            return StepBatches(SyntheticLoader(spec.per_group(), num_classes, steps), spec)
        return SyntheticLoader(spec, num_classes, steps, eval_batches)

    return build
