"""One rank's epoch geometry, shared by every format: batches, real samples, and the positions of its views.

Training follows the canonical layout, a function of the recipe alone: step s takes the epoch's view positions
[s*B, (s+1)*B) (B the global batch), cut into K canonical groups of g = B / K samples; position s*B + j*K + k is
slot j of group k, so consecutive views (an image's repeated-augmentation copies) land in different groups, as DeiT's
RASampler deals them to different ranks. Rank r of W holds consecutive groups, K // W of them, one more on the first
K % W ranks (``config.group_shares``: any W up to K; 32 groups on 24 ranks: 8 ranks x 2, 16 x 1), so the global batch
in canonical order is the ranks' batches one after the other: every sample has the same place in the global batch,
the same seed and the same Mixup partner at any world size. The epoch has N // B steps (the last partial global
batch dropped, no padding).

Micro-batches: every rank runs the same number A of them per step (FSDP2 and DeepSpeed run collectives in each),
A = ceil(c / G) for the busiest rank's c groups and micro-batches of G = micro / g groups; a rank cuts its own c_r
groups into A near-equal runs of whole groups (``LoaderSpec.micro_parts``). A rank with fewer groups than A (one group
per micro-batch, unequal shares) repeats its last micro-batch with weight 0: the same shapes and collectives, no
gradient. The step weights each micro-batch's mean loss by its samples (train/step.py), so the step is the same at any
world size. Where a rank's micro-batches are not all of ``micro`` samples, its format loader reads one group per
batch and ``StepBatches`` (data/steps.py) assembles the step's micro-batches from them.

Evaluation: rank r holds the contiguous positions [r*V, (r+1)*V) with V = ceil(N / world), the last batch may be
partial, positions past N repeat earlier samples and only the first ``num_real`` of a rank count.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from functools import cached_property
from typing import NamedTuple

import numpy as np

from ..config import group_shares
from ..errors import BadInput
from .faults import DataError
from .order import contiguous_range, epoch_views, views_per_rank


class MicroPart(NamedTuple):
    """One of a rank's micro-batches of a step: its canonical groups, and the samples that count in the loss."""

    first_group: int
    """The micro-batch's first canonical group (the Mixup draws of groups [first_group, first_group + groups))."""
    groups: int
    samples: int
    """Samples weighted in the loss: groups x g, or 0 for a repeat that only keeps the ranks' collectives in step."""


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
    handover: str = "pixels"
    """Train, with ``augment_on_device``: what the loader hands the training device (``device_images.py``):
    "pixels" (the crops at ``img_size``), "box" (the crop boxes at their own size, ``batch.Boxes``) or "jpeg" (the
    views undecoded, ``batch.Encoded``)."""
    global_batch_size: int | None = None
    """Train: the recipe's global batch B (None: micro-batch x world, no accumulation)."""
    canonical_groups: int | None = None
    """Train: the recipe's canonical groups K (None: one per rank)."""

    def __post_init__(self):
        if self.handover not in ("pixels", "box", "jpeg") or (self.handover != "pixels" and not (
                self.train and self.augment_on_device)):
            raise ValueError(f"LoaderSpec: handover {self.handover!r} needs a train split augmented on the device "
                             "(allowed: pixels, box, jpeg)")
        if self.train:
            b, k, w, m = self.global_batch, self.groups, self.world_size, self.micro_batch_size
            if b % k or not 1 <= w <= k or m % (b // k):
                raise BadInput(f"LoaderSpec: a global batch of {b} in {k} canonical groups does not split over "
                               f"{w} rank(s) in micro-batches of {m} (B % K == 0, W <= K, micro % (B/K) == 0)")

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

    @cached_property
    def shares(self) -> list[int]:
        """The canonical groups of each rank (train)."""
        return group_shares(self.groups, self.world_size)

    @property
    def rank_groups(self) -> int:
        """The canonical groups this rank holds in each step."""
        return self.shares[self.rank]

    @property
    def rank_samples(self) -> int:
        """The samples this rank holds in each step."""
        return self.rank_groups * self.group_size

    @property
    def first_group(self) -> int:
        """The first canonical group of this rank."""
        return contiguous_range(self.groups, self.world_size, self.rank)[0]

    @property
    def accum(self) -> int:
        """Micro-batches per optimizer step, the same on every rank: the busiest rank's groups in micro-batches of
        ``micro_batch_size`` (equal shares: B / (W x micro))."""
        return math.ceil(max(self.shares) * self.group_size / self.micro_batch_size)

    @cached_property
    def micro_parts(self) -> list[MicroPart]:
        """This rank's ``accum`` micro-batches of a step: its groups cut into near-equal consecutive runs (the first
        ones one group longer); a part past its groups repeats the last one with no samples counted."""
        parts, c, a, first = [], self.rank_groups, self.accum, self.first_group
        for j in range(a):
            lo, hi = contiguous_range(c, a, j)
            parts.append(MicroPart(first + lo, hi - lo, (hi - lo) * self.group_size) if hi > lo
                         else parts[-1]._replace(samples=0))
        return parts

    @property
    def whole_micro_batches(self) -> bool:
        """Whether every micro-batch of this rank holds ``micro_batch_size`` samples (eval: always): its format loader
        then yields them as they are; else it reads one group per batch (``per_group``) for ``StepBatches``."""
        return not self.train or all(p.samples == self.micro_batch_size for p in self.micro_parts)

    def per_group(self) -> "LoaderSpec":
        """This spec with one canonical group per batch: what a format loader reads for ``StepBatches``."""
        return replace(self, micro_batch_size=self.group_size)

    @property
    def batches_per_step(self) -> int:
        """Train: the format loader's batches of a step on this rank (of ``micro_batch_size``, which divides the
        rank's samples whenever a format loader reads them: ``whole_micro_batches``, or ``per_group``)."""
        return self.rank_samples // self.micro_batch_size


def eval_positions(num_samples: int, spec: LoaderSpec) -> tuple[np.ndarray, int]:
    """Contiguous eval positions of this rank (wrapped past N) and how many of them are real."""
    v = views_per_rank(num_samples, spec.world_size)
    start = spec.rank * v
    return np.arange(start, start + v) % num_samples, max(0, min(v, num_samples - start))


def slot_positions(spec: LoaderSpec, step, group, slots) -> np.ndarray:
    """Train: the epoch positions of slots ``slots`` of canonical group ``group`` in step ``step`` (arrays or ints):
    s*B + j*K + k, the one place the canonical layout is written."""
    return step * spec.global_batch + slots * spec.groups + group


def canonical_positions(spec: LoaderSpec, first_view: int, last_view: int) -> np.ndarray:
    """Train: the epoch positions of this rank's views [first_view, last_view), counted over its steps (its groups'
    samples a step, in canonical order: its groups one after the other, each slot by slot)."""
    g = spec.group_size
    i = np.arange(first_view, last_view, dtype=np.int64)
    step, t = np.divmod(i, spec.rank_samples)
    return slot_positions(spec, step, spec.first_group + t // g, t % g)


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
            num_batches = steps * spec.batches_per_step
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
