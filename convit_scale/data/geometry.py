"""One rank's epoch geometry, shared by every format: batches, real samples, and the positions of its views.

Training follows the canonical layout, a function of the recipe alone: step s takes the epoch's view positions
[s*B, (s+1)*B) (B the global batch), cut into K canonical groups of g = B / K samples; position s*B + j*K + k is
slot j of group k, so consecutive views (an image's repeated-augmentation copies) land in different groups, as DeiT's
RASampler deals them to different ranks. Rank r of W takes the groups [r*K/W, (r+1)*K/W) (K % W == 0), in order, and
its micro-batches are consecutive runs of them (the micro-batch a multiple of g): every sample has the same place in
the global batch, the same seed and the same Mixup partner at any world size. The epoch has N // B steps (the last
partial global batch dropped, no padding).

Evaluation: rank r holds the contiguous positions [r*V, (r+1)*V) with V = ceil(N / world), the last batch may be
partial, positions past N repeat earlier samples and only the first ``num_real`` of a rank count.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from .faults import DataError
from .order import epoch_views, views_per_rank


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
    """Stop at uint8 images (train: cropped and flipped; eval: resized and centre-cropped): the training device does
    RandAugment, normalisation and erasing (device_augment.py)."""
    global_batch_size: int | None = None
    """Train: the recipe's global batch B (None: micro-batch x world, no accumulation)."""
    canonical_groups: int | None = None
    """Train: the recipe's canonical groups K (None: one per rank)."""

    def __post_init__(self):
        if self.train:
            b, k, w, m = self.global_batch, self.groups, self.world_size, self.micro_batch_size
            if b % k or k % w or (b // w) % m or m % (b // k):
                raise ValueError(f"LoaderSpec: a global batch of {b} in {k} canonical groups does not split over "
                                 f"{w} rank(s) in micro-batches of {m} (K % W == 0, B/W % micro == 0, micro % (B/K) "
                                 f"== 0)")

    @property
    def train(self) -> bool:
        return self.split == "train"

    @property
    def global_batch(self) -> int:
        return self.global_batch_size or self.micro_batch_size * self.world_size

    @property
    def groups(self) -> int:
        return self.canonical_groups or self.world_size

    @property
    def group_size(self) -> int:
        """g: samples per canonical group."""
        return self.global_batch // self.groups

    @property
    def accum(self) -> int:
        """Micro-batches per optimizer step on each rank."""
        return self.global_batch // (self.world_size * self.micro_batch_size)

    @property
    def first_group(self) -> int:
        """The first canonical group of this rank."""
        return self.rank * (self.groups // self.world_size)


def eval_positions(num_samples: int, spec: LoaderSpec) -> tuple[np.ndarray, int]:
    """Contiguous eval positions of this rank (wrapped past N) and how many of them are real."""
    v = views_per_rank(num_samples, spec.world_size)
    start = spec.rank * v
    return np.arange(start, start + v) % num_samples, max(0, min(v, num_samples - start))


def canonical_positions(spec: LoaderSpec, first_view: int, last_view: int) -> np.ndarray:
    """Train: the epoch positions of this rank's views [first_view, last_view), counted over its steps (B / W views a
    step, in canonical order: its groups one after the other, each slot by slot)."""
    b, k, g = spec.global_batch, spec.groups, spec.group_size
    i = np.arange(first_view, last_view, dtype=np.int64)
    step, t = np.divmod(i, b // spec.world_size)
    return step * b + (t % g) * k + spec.first_group + t // g


@dataclass(frozen=True)
class EpochGeometry:
    """How many batches and real samples one rank has per epoch (the same on every rank), and its views' positions."""

    num_samples: int
    spec: LoaderSpec
    num_real: int
    num_batches: int
    steps: int
    """Train: optimizer steps per epoch (eval: 0)."""

    @classmethod
    def of(cls, num_samples: int, spec: LoaderSpec, source: str, steps: int | None = None) -> "EpochGeometry":
        """The geometry of ``num_samples`` under ``spec`` (train: ``steps`` steps, by default N // B); DataError
        naming ``source`` when no batch is left."""
        b = spec.micro_batch_size
        if spec.train:
            steps = num_samples // spec.global_batch if steps is None else steps
            if steps <= 0:
                raise DataError(f"{source}: {num_samples} {spec.split} samples give no global batch of "
                                f"{spec.global_batch}")
            num_batches = steps * spec.accum
            return cls(num_samples, spec, num_batches * b, num_batches, steps)
        v = views_per_rank(num_samples, spec.world_size)
        if v == 0:
            raise DataError(f"{source}: no {spec.split} samples")
        return cls(num_samples, spec, eval_positions(num_samples, spec)[1], math.ceil(v / b), 0)

    def positions(self, first_batch: int = 0) -> np.ndarray:
        """The positions in the epoch of this rank's views from batch ``first_batch`` to the end of the epoch (eval:
        sample indices, wrapped past N)."""
        s, b = self.spec, self.spec.micro_batch_size
        if s.train:
            return canonical_positions(s, first_batch * b, self.num_batches * b)
        return eval_positions(self.num_samples, s)[0][first_batch * b:]

    def sample_indices(self, epoch: int, repeats: int, first_batch: int = 0) -> tuple[np.ndarray, np.ndarray]:
        """Map-style formats: (sample index, position) of each view this rank reads in ``epoch`` from
        ``first_batch``."""
        positions = self.positions(first_batch)
        if not self.spec.train:
            return positions, positions
        return epoch_views(self.num_samples, self.spec.seed, epoch, repeats)[positions], positions
