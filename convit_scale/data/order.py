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
import torch

from ..splitmix import keys_of, mix64, srl


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


def view_seeds(seed: int, epoch: int, positions, stream: int = 0) -> np.ndarray:
    """The augmentation seeds in [0, 2**31) of the views at ``positions`` (their places in the epoch), as uint64:
    a pure function of (seed, epoch, stream, position) with no RNG stream to replay, so a resumed epoch and
    another world size see the same seeds. Every format seeds its views here; ``stream`` keeps other draws (a
    step's Mixup and drop-path) apart from the views'."""
    key0, key1, key2 = keys_of(torch.tensor([seed, epoch, stream], dtype=torch.int64)).unbind()
    h = mix64(torch.as_tensor(np.asarray(positions, dtype=np.int64)) ^ key0)
    h = mix64(h ^ key1) if stream == 0 else mix64(mix64(h ^ key2) ^ key1)
    return srl(h, 33).numpy().astype(np.uint64)


def step_seed(seed: int, epoch: int, step: int, rank: int) -> int:
    """The seed of a step's own draws on one rank (Mixup/CutMix, drop-path)."""
    return int(view_seeds(seed, epoch, [step * (1 << 20) + rank], stream=1)[0])
