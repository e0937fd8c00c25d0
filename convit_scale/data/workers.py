"""What every torch DataLoader of the package shares: a private generator for the workers' seeds, and
workers that leave the stop signals to the main process.

Slurm's preemption and time limit send SIGTERM to every process of the job step, DataLoader workers
included. A worker killed by it makes the main process raise (torch's SIGCHLD handler, or the next batch)
instead of saving. So a worker ignores SIGTERM unless its main process sent it: that one is
``multiprocessing``'s ``terminate()`` (torch's shutdown of a stuck worker, the interpreter's exit), and a
worker deaf to it would hang its main process's exit for ever. SIGUSR1 and SIGINT are never sent by the
main process and are ignored outright.

The signals must not be able to arrive between the fork and the worker's first line: ``iterate`` starts
the workers with the stop signals blocked in the forking thread, so they are born blocked (a fork and an
exec keep the mask), and a signal that came meanwhile waits, pending, for the worker to decide.

That holds only where the training process itself forks or spawns its workers. With ``forkserver`` (the
default start method from Python 3.14 on Linux, or a library's ``set_start_method``) a server process forks
them with the mask it was started with, maybe long before, and the server is itself in the job step: Slurm's
SIGTERM ends it, and the next epoch's workers cannot start. So the package's DataLoaders name their start
method (``START_METHOD`` in ``loader_options``: fork, what torch's DataLoader has used on Linux until Python
3.14; spawn where there is no fork), and ``iterate`` refuses a loader whose workers a forkserver would make.

A forked worker can also hang before its first line: CPython before 3.12 (fixed in the 3.10 and 3.11 security
releases of September 2024; 3.11.7 here) takes a lock in the child (the runtime's thread-state lock, gh-112275)
before resetting it, and if another thread of the parent held it at the fork, the child waits for ever inside
``os.fork()``, and its main process for the worker's first batch. Seen here: one epoch end of about 100 of a
2-rank CPU run (the child's stack: ``PyOS_AfterFork_Child`` -> ``_PyThreadState_DeleteExcept`` -> a lock wait; the
other rank waited in the next collective until its timeout). So ``iterate`` waits until each worker of the
package's loaders has run its first line (``WorkerInit`` marks it in shared memory), and kills a worker that has
not within ``START_TIMEOUT_S`` and starts the workers again, at most ``START_ATTEMPTS`` times (then a
``WorkerStartError``: the rank ends as a crash, which the Slurm launcher restarts).
"""

from __future__ import annotations

import logging
import multiprocessing
import os
import signal
import threading
import time

import torch

log = logging.getLogger(__name__)

STOP_SIGNALS = (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT)
_IGNORED = (signal.SIGUSR1, signal.SIGINT)
START_METHOD = "fork" if "fork" in multiprocessing.get_all_start_methods() else "spawn"
"""The ``multiprocessing_context`` of every DataLoader of the package (the module says why)."""


def private_generator(seed: int, epoch: int) -> torch.Generator:
    """DataLoader draws worker seeds from a generator: keep it off the global RNG, so creating an
    iterator in the middle of an epoch (a resume) leaves the training step's random numbers alone."""
    return torch.Generator().manual_seed(seed * 1000003 + epoch)


def loader_options(num_workers: int, seed: int, epoch: int) -> dict:
    """What every DataLoader of the package passes: ``num_workers``, the private generator for the workers'
    seeds, their signal set-up and start mark, and their start method (none without workers: torch refuses one
    there)."""
    return {"num_workers": num_workers, "generator": private_generator(seed, epoch),
            "worker_init_fn": worker_init_fn(num_workers=num_workers),
            "multiprocessing_context": START_METHOD if num_workers else None}


def iterate(loader):
    """The batches of a torch DataLoader whose workers are started with the stop signals blocked."""
    if loader.num_workers == 0:
        yield from loader
        return
    ctx = loader.multiprocessing_context or torch.multiprocessing.get_context()
    if ctx.get_start_method() == "forkserver":
        raise ValueError("DataLoader workers started by a forkserver are not born with the stop signals blocked, "
                         f"and Slurm's SIGTERM ends the server; give the DataLoader multiprocessing_context="
                         f"{START_METHOD!r} (convit_scale.data.workers.START_METHOD)")
    init = _start_marks(loader, ctx.get_start_method())
    for attempt in range(1, START_ATTEMPTS + 1):
        it, stuck = _start(loader, init)
        if not stuck:
            yield from it
            return
        pids = ", ".join(str(p.pid) for p in stuck)
        if attempt < START_ATTEMPTS:
            log.warning("DataLoader worker(s) %s did not start within %g s (a fork that hung in the child); killed, "
                        "starting the workers again (attempt %d of %d)", pids, START_TIMEOUT_S, attempt + 1,
                        START_ATTEMPTS)
        del it  # torch ends the attempt's other workers (and no longer watches these: their kill is not an error)
        for p in stuck:
            p.kill()  # SIGTERM is blocked in them from birth
            p.join(10)
    raise WorkerStartError(f"DataLoader workers did not start within {START_TIMEOUT_S:g} s, {START_ATTEMPTS} times "
                           f"(last: pid {pids}): their forks hang in the child; Python 3.12, or a 3.10/3.11 release "
                           f"from September 2024 on, has the interpreter's fix for one cause (gh-112275)")


class WorkerStartError(RuntimeError):
    """The workers of an epoch did not start, ``START_ATTEMPTS`` times: a fault of the machine, not of the data (the
    rank ends as a crash, which the Slurm launcher restarts from the newest checkpoint)."""


def _start_marks(loader, method: str) -> "WorkerInit | None":
    """The loader's ``WorkerInit`` when its workers' first lines are to be waited for: forked ones (a spawned
    worker is a new interpreter: no lock of the parent's threads, and its imports take seconds), started anew each
    epoch (persistent workers run their init once)."""
    init = loader.worker_init_fn
    if not isinstance(init, WorkerInit) or method != "fork" or loader.persistent_workers:
        return None
    if init.started.numel() < loader.num_workers:
        raise ValueError(f"worker_init_fn was made for {init.started.numel()} worker(s), the DataLoader starts "
                         f"{loader.num_workers}: make it with worker_init_fn(num_workers={loader.num_workers})")
    return init


def _start(loader, init: "WorkerInit | None"):
    """``iter(loader)``, its workers started with the stop signals blocked; and those of them that did not run
    their first line within ``START_TIMEOUT_S`` (none for a DataLoader whose init is not a ``WorkerInit``)."""
    if init is not None:
        known = {p.pid for p in multiprocessing.active_children()}
        init.started.zero_()
    before = signal.pthread_sigmask(signal.SIG_BLOCK, STOP_SIGNALS)
    try:
        it = iter(loader)
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, before)  # a signal that came meanwhile is handled now
    if init is None:
        return it, []
    # torch's own list of the iterator's workers where it has one (a process another thread started meanwhile is
    # not one of them), else this process's children that are new since the call
    started = getattr(it, "_workers", None) or [p for p in multiprocessing.active_children() if p.pid not in known]
    return it, init.unstarted(list(started), START_TIMEOUT_S)


def _exit_on_sigterm_from(main_pid: int) -> None:
    while True:
        if signal.sigwaitinfo({signal.SIGTERM}).si_pid == main_pid:
            os._exit(0)  # what torch's own worker handler does for its parent's SIGTERM


def _worker_signals(then, main_pid: int, worker_id: int) -> None:
    for sig in _IGNORED:
        signal.signal(sig, signal.SIG_IGN)
    # SIGTERM stays blocked in every thread (threads inherit the mask); one thread takes each with its
    # sender. Blocked, a signal is kept even if it was sent before this line.
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})
    threading.Thread(target=_exit_on_sigterm_from, args=(main_pid,), name="sigterm", daemon=True).start()
    signal.pthread_sigmask(signal.SIG_UNBLOCK, _IGNORED)
    if then is not None:
        then(worker_id)


START_TIMEOUT_S = 20.0
"""How long ``iterate`` waits for each forked worker's first line (a fork and torch's worker set-up take well under
a second, even from a process of tens of GB). A failed attempt costs this and torch's shutdown of the stuck worker
(two 5 s joins): the 3 attempts end within the watchdog's step timeout (``fault.hang_timeout_s``, 120 s)."""
START_ATTEMPTS = 3


class WorkerInit:
    """A DataLoader ``worker_init_fn`` that marks the worker started (its pid, in memory shared with the main
    process), sets its signals as the module says, then calls ``then`` (if given). Made in the main process, which
    it records; picklable for spawn (the shared tensor travels as shared memory)."""

    def __init__(self, then=None, num_workers: int = 1):
        self.then, self.main_pid = then, os.getpid()
        self.started = torch.zeros(max(num_workers, 1), dtype=torch.int64).share_memory_()

    def __call__(self, worker_id: int) -> None:
        self.started[worker_id] = os.getpid()
        _worker_signals(self.then, self.main_pid, worker_id)

    def unstarted(self, workers: list, timeout_s: float) -> list:
        """Of ``workers`` (this attempt's new processes), those still alive and unmarked after ``timeout_s``; none
        as soon as every one is marked, or when an unmarked one has died (torch reports that on the next batch)."""
        deadline = time.monotonic() + timeout_s
        while True:
            late = time.monotonic() >= deadline
            marked = set(self.started.tolist())  # read after the clock: a mark made at the deadline counts
            waiting = [p for p in workers if p.pid not in marked]
            if not waiting or any(not p.is_alive() for p in waiting):
                return []
            if late:
                return waiting
            time.sleep(0.005)


def worker_init_fn(then=None, num_workers: int = 1) -> WorkerInit:
    """The package's DataLoader ``worker_init_fn`` for up to ``num_workers`` workers (``WorkerInit``; ``iterate``
    refuses a loader of more). Call it in the main process."""
    return WorkerInit(then, num_workers)
