"""What every torch DataLoader of the package shares: a private generator for the workers' seeds, and
workers that leave the stop signals to the main process."""

from __future__ import annotations

import functools
import signal

import torch

STOP_SIGNALS = (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT)


def private_generator(seed: int, epoch: int) -> torch.Generator:
    """DataLoader draws worker seeds from a generator: keep it off the global RNG, so creating an
    iterator in the middle of an epoch (a resume) leaves the training step's random numbers alone."""
    return torch.Generator().manual_seed(seed * 1000003 + epoch)


def _ignore_stop_signals(then, worker_id: int) -> None:
    for sig in STOP_SIGNALS:
        signal.signal(sig, signal.SIG_IGN)
    if then is not None:
        then(worker_id)


def worker_init_fn(then=None):
    """A DataLoader ``worker_init_fn`` (then ``then``, if given). Slurm's preemption sends SIGTERM to every
    process of the job step, DataLoader workers included: a worker killed by it makes the main process
    raise instead of saving. Workers ignore SIGTERM, SIGUSR1 and SIGINT; the main process handles them,
    saves, and shuts its workers down. A module-level partial: picklable for forkserver and spawn."""
    return functools.partial(_ignore_stop_signals, then)
