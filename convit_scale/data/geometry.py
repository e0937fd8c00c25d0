"""One rank's epoch geometry, shared by every format: views, real samples, batches, and the positions.

- train: ceil(N / world) views per rank, the last partial batch dropped, every view real;
- eval: rank r holds the contiguous positions [r*V, (r+1)*V) with V = ceil(N / world), the last batch may
  be partial, positions past N repeat earlier samples and only the first ``num_real`` of a rank count.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from .faults import DataError
from .order import rank_indices, views_per_rank


@dataclass
class LoaderSpec:
    """Everything a loader needs besides the data section."""

    split: str  # "train" or "val"
    img_size: int
    micro_batch_size: int
    world_size: int = 1
    rank: int = 0
    seed: int = 0
    pin_memory: bool = False
    """Batches in page-locked memory (training on a GPU): the copy to the device overlaps compute."""
    augment_on_device: bool = False
    """Stop at uint8 images (train: cropped and flipped, with ``Batch.seeds``; eval: resized and centre-cropped):
    the training device does RandAugment, normalisation and erasing (device_augment.py)."""

    @property
    def train(self) -> bool:
        return self.split == "train"


def eval_positions(num_samples: int, spec: LoaderSpec) -> tuple[np.ndarray, int]:
    """Contiguous eval positions of this rank (wrapped past N) and how many of them are real."""
    v = views_per_rank(num_samples, spec.world_size)
    start = spec.rank * v
    return np.arange(start, start + v) % num_samples, max(0, min(v, num_samples - start))


@dataclass(frozen=True)
class EpochGeometry:
    """How many views, real samples and batches one rank has per epoch (the same on every rank)."""

    num_samples: int
    spec: LoaderSpec
    views_per_rank: int
    num_real: int
    num_batches: int

    @classmethod
    def of(cls, num_samples: int, spec: LoaderSpec, source: str) -> "EpochGeometry":
        """The geometry of ``num_samples`` under ``spec``; DataError naming ``source`` when no batch is left."""
        v, b = views_per_rank(num_samples, spec.world_size), spec.micro_batch_size
        num_real = v if spec.train else eval_positions(num_samples, spec)[1]
        num_batches = v // b if spec.train else math.ceil(v / b)
        if num_batches == 0:
            raise DataError(f"{source}: {num_samples} {spec.split} samples give no batch of {b} "
                            f"on each of {spec.world_size} ranks")
        return cls(num_samples, spec, v, num_real, num_batches)

    def sample_indices(self, epoch: int, repeats: int) -> np.ndarray:
        """Map-style formats: the sample index of each view this rank reads in ``epoch``, whole batches only."""
        s = self.spec
        if s.train:
            idx = rank_indices(self.num_samples, s.world_size, s.rank, s.seed, epoch, repeats)
        else:
            idx = eval_positions(self.num_samples, s)[0]
        return idx[: self.num_batches * s.micro_batch_size]

    def global_positions(self, first_view: int, count: int) -> np.ndarray:
        """Positions in the whole epoch (all ranks) of this rank's views [first_view, first_view + count):
        the view k of rank r is r + k * world, so a sample's augmentation does not depend on the world size."""
        return self.spec.rank + np.arange(first_view, first_view + count, dtype=np.int64) * self.spec.world_size
