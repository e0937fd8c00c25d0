"""ffcv's epoch machinery as replaced (convit_scale/data/ffcv_epoch.py): num_workers threads decoding whole batches,
no thread outliving its epoch, a batch slot never rewritten while its batch is alive, a thread's failure raised.

numba compiles every new ffcv Loader (seconds), so each test builds at most two loaders.
"""

import gc
import threading
import time

import pytest
import torch
from support import ffcv_loader


def test_abandoned_epochs_leave_no_thread(fm_ffcv):
    loader = ffcv_loader(fm_ffcv, workers=2, split="val")
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
    buffers = loader.ffcv_loader().epoch_buffers
    second = loader.epoch(1)
    next(second)
    assert loader.ffcv_loader().epoch_buffers is buffers  # kept from epoch to epoch, not allocated again
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
        loader = ffcv_loader(fm_ffcv, workers=2)
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
    loader = ffcv_loader(fm_ffcv, workers=3)
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
    loader = ffcv_loader(fm_ffcv, workers=2, split="val")
    baseline = threading.active_count()
    got = []
    with pytest.raises(RuntimeError, match="ffcv's loader thread failed: MemoryError: no room for the batch"):
        for batch in loader.epoch(0):
            got.append(batch)
    assert len(got) == 2
    assert threading.active_count() == baseline, threading.enumerate()
