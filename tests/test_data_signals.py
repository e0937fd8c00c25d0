"""DataLoader workers survive the stop signals a Slurm preemption sends to the whole job step."""

import os
import pickle
import signal
import time

import psutil
import pytest
import torch

from convit_scale.config import DataConfig
from convit_scale.data import LoaderSpec, build_loader
from convit_scale.data.workers import worker_init_fn


@pytest.mark.parametrize("fmt", ["imagefolder", "wds"])
def test_workers_ignore_sigterm_and_the_epoch_continues(fmt, fm_tree, fm_wds):
    path = fm_tree if fmt == "imagefolder" else fm_wds
    d = DataConfig(format=fmt, train_path=str(path), val_path=str(path), num_workers=2, repeated_aug=1)
    loader = build_loader(d, LoaderSpec("val", 32, 25))
    want = list(loader.epoch(0))
    got, killed = [], []
    others = {p.pid for p in psutil.Process().children()}  # processes left by earlier tests are not ours
    for x, y in loader.epoch(0):
        got.append((x, y))
        if not killed:
            workers = [p for p in psutil.Process().children() if p.pid not in others]
            assert len(workers) == 2
            for w in workers:
                os.kill(w.pid, signal.SIGTERM)
                killed.append(w.pid)
            time.sleep(0.5)  # a worker killed by the signal would be reported on the next batch
    assert killed and len(got) == len(want) == len(loader)
    assert all(torch.equal(a, c) and torch.equal(b, e) for (a, b), (c, e) in zip(got, want))


def test_worker_init_fn_composes_and_pickles():
    calls = []
    pickle.dumps(worker_init_fn(), protocol=pickle.HIGHEST_PROTOCOL)  # forkserver and spawn send it to the worker
    before = signal.getsignal(signal.SIGTERM)
    try:
        worker_init_fn(calls.append)(3)
        assert calls == [3] and signal.getsignal(signal.SIGTERM) is signal.SIG_IGN
    finally:
        for sig in (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT):
            signal.signal(sig, before if sig == signal.SIGTERM else signal.default_int_handler
                          if sig == signal.SIGINT else signal.SIG_DFL)
