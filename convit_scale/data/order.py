"""The order of an epoch's samples and the seeds of its random draws: pure functions of the recipe (N, seed, epoch,
global batch, canonical groups), never of the world size, so a run resumed on another number of ranks continues the
same run, sample for sample.

Repeated augmentation follows DeiT's RASampler: an epoch has N views in total, made of the permutation's first
ceil(N / repeats) images shown ``repeats`` times each (differently augmented), consecutively in the view sequence,
and the canonical layout (geometry.py) spreads consecutive views over different groups of a step, as RASampler deals
them to different ranks.
"""

from __future__ import annotations

import math

import numpy as np
import torch

from ..splitmix import keys_of, mix64, srl


def views_per_rank(num_samples: int, world_size: int) -> int:
    """Evaluation: samples each rank processes, ceil(N / world), so the padding is <= world - 1."""
    return math.ceil(num_samples / world_size)


def epoch_permutation(num_samples: int, seed: int, epoch: int) -> np.ndarray:
    return np.random.default_rng([seed, epoch]).permutation(num_samples)


def epoch_views(num_samples: int, seed: int, epoch: int, repeats: int = 1) -> np.ndarray:
    """Map-style datasets (ImageFolder, FFCV): the sample index of each view of the epoch, in the epoch's order (N of
    them): the permutation's first ceil(N / repeats) images, each ``repeats`` times in a row."""
    order = epoch_permutation(num_samples, seed, epoch)
    return np.repeat(order[: math.ceil(num_samples / repeats)], repeats)[:num_samples]


def contiguous_range(num_items: int, parts: int, part: int) -> tuple[int, int]:
    """[start, stop) of part ``part`` when ``num_items`` are cut into ``parts`` near-equal pieces."""
    base, extra = divmod(num_items, parts)
    start = part * base + min(part, extra)
    return start, start + base + (part < extra)


def view_seeds(seed: int, epoch: int, positions, stream: int = 0) -> np.ndarray:
    """The augmentation seeds in [0, 2**31) of the views at ``positions`` (their places in the epoch), as uint64:
    a pure function of (seed, epoch, stream, position) with no RNG stream to replay, so a resumed epoch and
    another world size see the same seeds. Every format seeds its views here; ``stream`` keeps other draws (a
    step's own seed, the Mixup of a canonical group) apart from the views'."""
    key0, key1, key2 = keys_of(torch.tensor([seed, epoch, stream], dtype=torch.int64)).unbind()
    h = mix64(torch.as_tensor(np.asarray(positions, dtype=np.int64)) ^ key0)
    h = mix64(h ^ key1) if stream == 0 else mix64(mix64(h ^ key2) ^ key1)
    return srl(h, 33).numpy().astype(np.uint64)


STEP_STREAM, MIXUP_STREAM = 1, 2
"""``view_seeds`` streams: the seed of a step's global random state, and of each canonical group's Mixup/CutMix."""


def step_seed(seed: int, epoch: int, step: int) -> int:
    """The seed of whatever a step draws from the global generators (nothing of the package's own step does: Mixup
    and drop-path draw from the canonical groups' and the samples' seeds); the same on every rank and world size."""
    return int(view_seeds(seed, epoch, [step], stream=STEP_STREAM)[0])
