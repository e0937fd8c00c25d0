"""FFCV loader: exact (seeded per view), resumable at any batch, and no thread outliving its epoch.

numba compiles every new ffcv Loader (seconds), so each test builds at most two loaders.
"""

import gc
import random
import threading
import time

import numpy as np
import pytest
import torch

from convit_scale.config import DataConfig
from convit_scale.data import LoaderSpec, build_loader


def _loader(path, workers: int, split: str = "train", repeats: int = 1):
    d = DataConfig(format="ffcv", train_path=str(path), val_path=str(path), num_workers=workers, repeated_aug=repeats)
    return build_loader(d, LoaderSpec(split, 32, 16, seed=3))


def _take(it, n):
    return [(x.clone(), y.clone()) for _, (x, y) in zip(range(n), it)]


def _equal(a, b) -> bool:
    return len(a) == len(b) and all(torch.equal(x, u) and torch.equal(y, v) for (x, y), (u, v) in zip(a, b))


def _global_rng_state():
    return random.getstate(), np.random.get_state()[1].tobytes(), torch.get_rng_state()


def test_resume_first_then_every_epoch_full_and_bit_identical(fm_ffcv):
    # repeats=3 on one rank: each image comes three times per epoch and must be augmented three ways
    loader = _loader(fm_ffcv, workers=2, repeats=3)
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
        loader = _loader(fm_ffcv, workers)
        before = _global_rng_state()
        first = _take(loader.epoch(0), 4)
        time.sleep(0.5)  # the loader thread keeps preparing batches ahead
        after = _global_rng_state()
        assert before[0] == after[0] and before[1] == after[1] and torch.equal(before[2], after[2])
        assert _equal(first, _take(loader.epoch(0), 4))
        assert not _equal(first, _take(loader.epoch(1), 4))
        batches[workers] = first
    assert _equal(batches[0], batches[2])  # the crop is a function of the view, not of the thread


def test_abandoned_epochs_leave_no_thread(fm_ffcv):
    loader = _loader(fm_ffcv, workers=2, split="val")
    baseline = threading.active_count()
    for epoch in range(5):
        it = iter(loader.epoch(epoch))
        next(it)
        del it  # dropped part-way, as a stopped run does
    gc.collect()
    assert threading.active_count() == baseline, threading.enumerate()
    it = loader.epoch(0)
    next(it)
    it.close()
    assert threading.active_count() == baseline, threading.enumerate()
    first = loader.epoch(0)  # the loader's buffers are shared: a new epoch closes the one before, which says so
    next(first)
    buffers = loader._ffcv_loader().epoch_buffers
    second = loader.epoch(1)
    next(second)
    assert loader._ffcv_loader().epoch_buffers is buffers  # kept from epoch to epoch, not allocated again
    with pytest.raises(RuntimeError, match="closed when a new epoch of the same loader started"):
        next(first)
    second.close()
    assert threading.active_count() == baseline, threading.enumerate()


def test_decoder_threads_are_the_workers_and_torch_count_untouched(fm_ffcv):
    """num_workers threads decode whole batches (bench data: ffcv's one batch at a time over its threads waits
    at every batch's end for the slowest), OpenCV's resize runs without a pool of its own inside each of them (one
    thread per core per worker otherwise), and torch's count is left alone, by the loader and by importing ffcv."""
    import os
    import subprocess
    import sys

    before = torch.get_num_threads()
    torch.set_num_threads(1)  # the training step's threads (OMP_NUM_THREADS) are not the loader's to change
    try:
        loader = _loader(fm_ffcv, workers=2)
        it = loader.epoch(0)
        next(it)
        assert sorted(t.name for t in threading.enumerate() if t.name.startswith("ffcv-")) == ["ffcv-epoch-0",
                                                                                              "ffcv-epoch-1"]
        it.close()
        assert torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(before)
    assert os.environ["OPENCV_FOR_THREADS_NUM"] == "1"
    # importing ffcv compiles no numba typed Dict for its image modes (7 s per process), and numba's Dict is left
    code = ("import torch; torch.set_num_threads(3); import convit_scale.data.ffcv; import numba.typed; "
            "from ffcv.fields.rgb_image import IMAGE_MODES as m; "
            "print(torch.get_num_threads(), type(m).__name__, m['jpg'], numba.typed.Dict.__module__)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.split()[-4:] == ["3", "dict", "0", "numba.typed.typeddict"], out


def test_a_batch_slot_is_never_rewritten_while_its_batch_is_alive(fm_ffcv, monkeypatch):
    """Threads that run ahead of a slow consumer, as far as their queues allow, never write a slot whose batch is
    queued or still held by the consumer (it holds the batch it took until it asks for the next)."""
    from convit_scale.data.ffcv_epoch import EpochIterator as _EpochIterator

    run_pipeline, take = _EpochIterator.run_pipeline, _EpochIterator.__next__
    lock, alive, clashes = threading.Lock(), {}, []  # batch -> slot, from its start until the consumer lets it go

    def watched_run(self, b, indices, slot):
        with lock:
            if slot in alive.values():
                clashes.append((b, slot, dict(alive)))
            alive[b] = slot
        return run_pipeline(self, b, indices, slot)

    def slow_take(self):
        with lock:
            alive.pop(self.next_batch - 1, None)  # asking for the next batch lets the last one go
        result = take(self)
        time.sleep(0.01)
        return result

    monkeypatch.setattr(_EpochIterator, "run_pipeline", watched_run)
    monkeypatch.setattr(_EpochIterator, "__next__", slow_take)
    loader = _loader(fm_ffcv, workers=3)
    assert sum(1 for _ in loader.epoch(0)) == len(loader) > 3 * 7  # 3 threads: 7 slots, used three times over
    assert not clashes, clashes[:3]


@pytest.mark.timeout(120)
def test_a_failure_in_ffcvs_thread_is_raised_not_waited_for(fm_ffcv, monkeypatch):
    """ffcv's epoch thread dies with an exception (a failed compilation, a read error); the consumer raises it."""
    from convit_scale.data.ffcv_epoch import EpochIterator as _EpochIterator

    run_pipeline = _EpochIterator.run_pipeline

    def fails_at_the_third_batch(self, b_ix, *args):
        if b_ix == 2:
            raise MemoryError("no room for the batch")
        return run_pipeline(self, b_ix, *args)

    monkeypatch.setattr(_EpochIterator, "run_pipeline", fails_at_the_third_batch)
    loader = _loader(fm_ffcv, workers=2, split="val")
    baseline = threading.active_count()
    got = []
    with pytest.raises(RuntimeError, match="ffcv's loader thread failed: MemoryError: no room for the batch"):
        for batch in loader.epoch(0):
            got.append(batch)
    assert len(got) == 2
    assert threading.active_count() == baseline, threading.enumerate()


@pytest.mark.parametrize("split,on_device", [("train", True), ("train", False), ("val", True)])
def test_batches_kept_by_the_consumer_are_not_overwritten(fm_ffcv, split, on_device):
    """Every batch is the consumer's to keep: a whole epoch held without copies equals one copied batch by batch
    (a batch that viewed a slot of the loader's buffers would hold a later batch's pixels)."""
    d = DataConfig(format="ffcv", train_path=str(fm_ffcv), val_path=str(fm_ffcv), num_workers=2, repeated_aug=1)
    loader = build_loader(d, LoaderSpec(split, 32, 16, seed=3, augment_on_device=on_device))
    kept = [(x, y) for x, y in loader.epoch(0)]
    assert len(kept) > 7  # more batches than the loader's slots at 2 workers
    assert _equal(kept, _take(loader.epoch(0), len(kept)))


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
