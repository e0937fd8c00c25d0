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
"""

from __future__ import annotations

import functools
import multiprocessing
import os
import signal
import threading

import torch

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
    seeds, their signal set-up, and their start method (none without workers: torch refuses one there)."""
    return {"num_workers": num_workers, "generator": private_generator(seed, epoch),
            "worker_init_fn": worker_init_fn(), "multiprocessing_context": START_METHOD if num_workers else None}


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
    before = signal.pthread_sigmask(signal.SIG_BLOCK, STOP_SIGNALS)
    try:
        it = iter(loader)
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, before)  # a signal that came meanwhile is handled now
    yield from it


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


def worker_init_fn(then=None):
    """A DataLoader ``worker_init_fn`` (then ``then``, if given) that sets the workers' signals as the module
    says. Call it in the main process: it records that process's pid. A module-level partial: picklable for
    forkserver and spawn."""
    return functools.partial(_worker_signals, then, os.getpid())
