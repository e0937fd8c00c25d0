"""ffcv's epoch machinery, replaced: the buffers of a loader's batches and the threads that fill them.

``EpochIterator`` runs one epoch of an ffcv ``Loader`` (its compiled stages, ``run_stages``) on threads that each
run whole batches, into buffers ``allocate`` made without page-locking. ``FfcvLoader`` starts it itself (never ffcv's
``Loader.__iter__``); ``bench data`` runs the same stages on threads of its own to measure the loader's ceiling.
"""

from __future__ import annotations

import queue
import threading

import numpy as np
import torch

from ..ffcv_threads import importing_ffcv

with importing_ffcv():
    from ffcv.loader import Loader
    from ffcv.loader.epoch_iterator import select_buffer
    from ffcv.memory_managers.os_cache import OSCacheManager
    from ffcv.pipeline.allocation_query import AllocationQuery

from .faults import reason_of


class SlotScratch(AllocationQuery):
    """Memory a decoder needs once per batch slot, not once per image: ``allocate`` gives it one row per slot. A
    batch is one thread's (``EpochIterator``) and its images are decoded one after the other into that row."""


def allocate(graph, batch_size: int, slots: int) -> dict:
    """ffcv's ``Graph.allocate_memory`` without page-locking: ffcv pins every buffer when CUDA is available, for
    its own device copies. Batches leave these buffers through the consumer's copy (into page-locked memory when
    the run pins), so they stay pageable, and what the decoders never touch (the scratch rows past a slot's first)
    takes no memory."""
    requirements, _ = graph.collect_requirements()

    def one(q: AllocationQuery):
        rows = 1 if isinstance(q, SlotScratch) else batch_size
        if isinstance(q.dtype, torch.dtype):
            return [torch.empty(rows, *q.shape, dtype=q.dtype, device=q.device) for _ in range(slots)]
        return np.empty((slots, rows, *q.shape), dtype=q.dtype)

    return {kind: {node: (one(q) if isinstance(q, AllocationQuery) else
                          tuple(one(x) for x in q) if isinstance(q, (tuple, list)) else None)
                   for node, q in queries.items()}
            for kind, queries in requirements.items()}


def run_stages(loader: Loader, memory: dict, slot: int, batch_indices: np.ndarray, storage_state, metadata):
    """ffcv's ``EpochIterator.run_pipeline`` for a pipeline that stays on the CPU (no CUDA stream of its own): the
    loader's compiled stages on slot ``slot`` of ``memory`` (``allocate``'s buffers)."""
    code, outputs = loader.code
    args = {"batch_indices": batch_indices, "storage_state": storage_state, "metadata": metadata,
            **{f"{kind}_{k}": select_buffer(v, slot, len(batch_indices))
               for prefix, kind in (("operation", "memory"), ("shared", "shared_memory"))
               for k, v in memory[prefix].items()}}
    for stage_code, define_outputs in code:
        for node_id, result in zip(define_outputs, stage_code(**args)):
            args[f"result_{node_id}"] = result
    return tuple(args[f"result_{x}"] for x in outputs)


class EpochIterator:
    """One epoch of an ffcv Loader on ``num_workers`` threads that each run whole batches (batch k on thread
    k mod num_workers), handed out in order. ffcv's own runs one batch at a time on one thread, its decoders spread
    over the batch by numba's prange: every batch ends at a barrier (the threads that finish first wait for the
    last) and the batch's serial work runs with the other threads idle (what that costs: BENCHMARKS.md, "FFCV loader:
    measurements behind its design"). The threads are the epoch's: none outlives it. turbojpeg keeps a handle per
    thread that ffcv never frees: a few KB per thread and epoch, some tens of MB over a 300-epoch run.

    A thread that fails hands its exception to the consumer, which raises it naming the .beton (ffcv's thread
    died with it and its consumer waited on the queue for ever). ``close()`` stops and joins the threads.

    Slots: thread k writes batch b into slot b mod S of the loader's buffers. Thread k starts batch b only once
    b - N is in its queue (q batches at most), so the consumer has taken b - (q + 1) N and holds nothing older
    than that; every batch alive lies in (b - (q + 1) N, b], and S = (q + 1) N + 1 slots never collide. With one
    thread and q = batches_ahead that is ffcv's batches_ahead + 2. The buffers are the loader's, kept across epochs
    (ffcv allocated, and the kernel zeroed, hundreds of MB per epoch), so one epoch of a loader runs at a time: a
    new one closes the one before."""

    def __init__(self, loader: Loader, order: np.ndarray):
        if not isinstance(loader.memory_manager, OSCacheManager):  # the others schedule reads for one thread
            raise ValueError(f"{loader.fname}: the FFCV loader's threads need os_cache=True")
        previous = getattr(loader, "live_epoch", None)
        if previous is not None:
            previous.superseded = True
            previous.close()
        self.loader, self.num_threads = loader, max(1, loader.num_workers)
        self.batches = [order[i:i + loader.batch_size] for i in range(0, len(order), loader.batch_size)]
        ahead = max(1, -(-loader.batches_ahead // self.num_threads))
        self.slots = (ahead + 1) * self.num_threads + 1
        if getattr(loader, "epoch_buffers", (0, None))[0] != self.slots:
            loader.epoch_buffers = (self.slots, allocate(loader.graph, loader.batch_size, self.slots))
        self.memory = loader.epoch_buffers[1]
        self.memory_context = loader.memory_manager.schedule_epoch(self.batches)  # the reads of the .beton
        self.memory_context.__enter__()
        self.storage_state, self.metadata = self.memory_context.state, loader.reader.metadata
        self.queues = [queue.Queue(ahead) for _ in range(self.num_threads)]
        self.stop, self.next_batch, self.closed, self.superseded = threading.Event(), 0, False, False
        self.threads = [threading.Thread(target=self._work, args=(k,), daemon=True, name=f"ffcv-epoch-{k}")
                        for k in range(self.num_threads)]
        loader.live_epoch = self
        try:
            for t in self.threads:
                t.start()
        except BaseException:
            self.close()
            raise

    def run_pipeline(self, b_ix: int, batch_indices: np.ndarray, slot: int):
        return run_stages(self.loader, self.memory, slot, batch_indices, self.storage_state, self.metadata)

    def _work(self, k: int) -> None:
        try:
            for b in range(k, len(self.batches), self.num_threads):
                if self.stop.is_set() or not self._put(k, self.run_pipeline(b, self.batches[b], b % self.slots)):
                    return
            self._put(k, None)
        except BaseException as e:  # noqa: BLE001 - handed to the consumer, which raises it
            self._put(k, e)

    def _put(self, k: int, item) -> bool:
        while not self.stop.is_set():
            try:
                self.queues[k].put(item, timeout=0.5)
                return True
            except queue.Full:
                pass
        return False

    def __iter__(self):
        return self

    def __next__(self):
        if self.closed:
            if self.superseded:
                raise RuntimeError(f"{self.loader.fname}: this epoch was closed when a new epoch of the same loader "
                                   "started (its buffers are shared: one epoch of a loader at a time)")
            raise StopIteration()
        result = self.queues[self.next_batch % self.num_threads].get()
        if isinstance(result, BaseException):
            self.close()
            raise RuntimeError(f"{self.loader.fname}: ffcv's loader thread failed: {reason_of(result)}") from result
        if result is None:
            self.close()
            raise StopIteration()
        self.next_batch += 1
        return result

    def close(self) -> None:
        """Stop the threads and wait for them (one blocked on a full queue is let go by the stop flag)."""
        self.closed = True
        self.stop.set()
        for t in self.threads:
            while t.is_alive() and t is not threading.current_thread():
                for q in self.queues:
                    try:
                        q.get_nowait()
                    except queue.Empty:
                        pass
                t.join(timeout=0.05)
        if self.loader.live_epoch is self:
            self.loader.live_epoch = None
            self.memory_context.__exit__(None, None, None)
