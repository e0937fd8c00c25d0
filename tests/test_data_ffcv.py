"""The FFCV loader (convit_scale/data/ffcv.py): exact (seeded per view), resumable at any batch, every batch the
consumer's to keep. Its epoch threads and buffers are tested in test_data_ffcv_epoch.py.

numba compiles every new ffcv Loader (seconds), so each test builds at most two loaders.
"""

import random
import time

import numpy as np
import pytest
import torch
from support import ffcv_loader

from convit_scale.config import DataConfig
from convit_scale.data import LoaderSpec, build_loader


def _take(it, n):
    return [(x.clone(), y.clone()) for _, (x, y) in zip(range(n), it)]


def _equal(a, b) -> bool:
    return len(a) == len(b) and all(torch.equal(x, u) and torch.equal(y, v) for (x, y), (u, v) in zip(a, b))


def _global_rng_state():
    return random.getstate(), np.random.get_state()[1].tobytes(), torch.get_rng_state()


def test_resume_first_then_every_epoch_full_and_bit_identical(fm_ffcv):
    # repeats=3 on one rank: each image comes three times per epoch and must be augmented three ways
    loader = ffcv_loader(fm_ffcv, workers=2, repeats=3)
    n = len(loader)
    resumed = list(loader.epoch(0, start_batch=n - 11))  # a run resumed late in epoch 0 ...
    assert len(resumed) == 11
    for epoch in (1, 2):  # ... then runs whole epochs
        assert sum(1 for _ in loader.epoch(epoch)) == n
    full = _take(loader.epoch(0), n)
    assert _equal(resumed, full[n - 11:])
    assert _equal(_take(loader.epoch(0, start_batch=5), 3), full[5:8])
    x = full[0][0]
    assert not any(torch.equal(x[i], x[j]) for i in range(16) for j in range(i + 1, 16))  # repeats differ


def test_same_seed_same_batches_for_any_workers_and_global_rng_untouched(fm_ffcv):
    batches = {}
    for workers in (0, 2):
        loader = ffcv_loader(fm_ffcv, workers)
        before = _global_rng_state()
        first = _take(loader.epoch(0), 4)
        time.sleep(0.5)  # the loader thread keeps preparing batches ahead
        after = _global_rng_state()
        assert before[0] == after[0] and before[1] == after[1] and torch.equal(before[2], after[2])
        assert _equal(first, _take(loader.epoch(0), 4))
        assert not _equal(first, _take(loader.epoch(1), 4))
        batches[workers] = first
    assert _equal(batches[0], batches[2])  # the crop is a function of the view, not of the thread


@pytest.mark.parametrize("split,on_device", [("train", True), ("train", False), ("val", True)])
def test_batches_kept_by_the_consumer_are_not_overwritten(fm_ffcv, split, on_device):
    """Every batch is the consumer's to keep: a whole epoch held without copies equals one copied batch by batch
    (a batch that viewed a slot of the loader's buffers would hold a later batch's pixels)."""
    d = DataConfig(format="ffcv", train_path=str(fm_ffcv), val_path=str(fm_ffcv), num_workers=2, repeated_aug=1)
    loader = build_loader(d, LoaderSpec(split, 32, 16, seed=3, augment_on_device=on_device))
    kept = [(x, y) for x, y in loader.epoch(0)]
    assert len(kept) > 7  # more batches than the loader's slots at 2 workers
    assert _equal(kept, _take(loader.epoch(0), len(kept)))
