"""`bench data` (convit_scale/bench/data.py): loader throughput counted over whole waves of worker batches, and the
FFCV ceiling running the loader's own compiled pipeline."""

import pytest
import torch

from convit_scale.config import DataConfig
from convit_scale.data import LoaderSpec, build_loader


def test_bench_steady_state_counts_whole_waves_of_batches():
    """Two workers making a batch each per second, side by side: 2 batches/s, not the 9 batches in 4 s that
    counting from the first arrival gives; a last batch made alone (odd count) is left out."""
    from convit_scale.bench.data import steady_state

    arrivals = [1, 1, 2, 2, 3, 3, 4, 4, 5, 5]
    for tail in ([], [6]):
        images, seconds = steady_state(arrivals + tail, [64] * (10 + len(tail)), workers=2)
        assert (images, seconds) == (8 * 64, 4)
    assert steady_state([1, 2, 3, 4], [64] * 4, workers=1) == (3 * 64, 3)


def test_bench_ceiling_runs_the_loaders_own_pipeline(fm_ffcv, monkeypatch):
    """`bench data`'s FFCV ceiling (threads that share nothing, running the loader's compiled pipeline) does the
    loader's work: each thread's last batch is the loader's batch of that number, pixel for pixel; a thread's
    failure is raised, not counted as a rate."""
    from convit_scale.bench.data import ffcv_free_threads

    d = DataConfig(format="ffcv", train_path=str(fm_ffcv), val_path=str(fm_ffcv), num_workers=2, repeated_aug=1)
    loader = build_loader(d, LoaderSpec("train", 32, 16, seed=3, augment_on_device=True))
    batches = [(x, y) for x, y in loader.epoch(1)]
    images, seconds, last = ffcv_free_threads(loader, 1, 2, {})
    assert images == 16 * len(batches) and seconds > 0
    assert sorted(last) == [len(batches) - 2, len(batches) - 1]
    for b, (x, y) in last.items():
        assert torch.equal(x, batches[b][0]) and torch.equal(y.long(), batches[b][1])

    def fails(*args):
        raise MemoryError("no room")

    monkeypatch.setattr("convit_scale.bench.data.run_stages", fails)
    with pytest.raises(RuntimeError, match="the FFCV ceiling's thread failed: MemoryError"):
        ffcv_free_threads(loader, 1, 2, {})
