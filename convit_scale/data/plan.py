"""Which samples each rank sees in an epoch: pure functions of (N, world, rank, seed, epoch).

Every rank gets the same number of samples (no DDP/FSDP hang), each sample appears once per epoch and
per repeat up to a padding of at most world_size - 1 samples, the order changes every epoch and is
reproducible from the seed, and the position inside an epoch is a batch index, so a resumed run skips
straight to it.

Repeated augmentation follows DeiT's RASampler: an epoch still has N views in total, made of
ceil(N / repeats) distinct images shown ``repeats`` times each (differently augmented).
"""

from __future__ import annotations

import math

import numpy as np


def views_per_rank(num_samples: int, world_size: int) -> int:
    """Samples each rank processes per epoch: ceil(N / world), so the padding is <= world - 1."""
    return math.ceil(num_samples / world_size)


def epoch_permutation(num_samples: int, seed: int, epoch: int) -> np.ndarray:
    return np.random.default_rng([seed, epoch]).permutation(num_samples)


def rank_indices(num_samples: int, world_size: int, rank: int, seed: int, epoch: int,
                 repeats: int = 1, shuffle: bool = True) -> np.ndarray:
    """Map-style datasets (ImageFolder, FFCV): this rank's sample indices for ``epoch``.

    As DeiT's RASampler: the permutation's first ceil(total / repeats) images are each repeated
    ``repeats`` times and dealt round-robin to ranks, so the copies of an image land on different ranks.
    """
    total = views_per_rank(num_samples, world_size) * world_size
    order = epoch_permutation(num_samples, seed, epoch) if shuffle else np.arange(num_samples)
    unique = math.ceil(total / repeats)
    order = np.resize(order, unique)  # wraps around: the padding repeats the first samples
    views = np.repeat(order, repeats)[:total]
    return views[rank::world_size]


def contiguous_range(num_items: int, parts: int, part: int) -> tuple[int, int]:
    """[start, stop) of part ``part`` when ``num_items`` are cut into ``parts`` near-equal pieces."""
    base, extra = divmod(num_items, parts)
    start = part * base + min(part, extra)
    return start, start + base + (part < extra)


def sample_seed(seed: int, epoch: int, rank: int, position: int) -> int:
    """Augmentation seed of one sample view: resume-safe (no RNG stream to replay)."""
    return int(np.random.default_rng([seed, epoch, rank, position]).integers(2**31))


def _mix64(x: np.ndarray) -> np.ndarray:
    """splitmix64's finaliser on uint64 arrays (wraps modulo 2**64)."""
    x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return x ^ (x >> np.uint64(31))


def view_seeds(seed: int, epoch: int, positions: np.ndarray) -> np.ndarray:
    """Vectorised augmentation seeds in [0, 2**31) of the views at ``positions`` (global positions in the
    epoch): a pure function of (seed, epoch, position), as ``sample_seed`` but for a whole epoch at once."""
    key = _mix64(np.array([seed, epoch], dtype=np.uint64) + np.uint64(0x9E3779B97F4A7C15))
    h = _mix64(np.asarray(positions, dtype=np.uint64) ^ key[0])
    return _mix64(h ^ key[1]) >> np.uint64(33)
