"""DataLoader workers survive the stop signals a Slurm preemption sends to the whole job step, from the
instant they are forked, and still obey their own main process's ``terminate()``; a worker whose fork hangs in the
child is replaced."""

import logging
import os
import re
import signal
import subprocess
import sys
import textwrap
import time

import psutil
import pytest
import torch
from torch.utils.data import DataLoader, Dataset

from convit_scale.config import DataConfig
from convit_scale.data import LoaderSpec, build_loader, workers
from convit_scale.data.workers import iterate, loader_options, worker_init_fn
from convit_scale.manifest import DataError

_AT_BIRTH: list[int] = []  # signals a forked child sends itself on its first line, while the list is armed


def _signal_self_at_birth():
    for sig in _AT_BIRTH:
        os.kill(os.getpid(), sig)


_HANG_NEXT_FORKS = [0]  # how many of the next children forked hang on their first line


def _hang_at_birth():
    """Where CPython < 3.12 (before its September 2024 fixes) can hang a child forked while another thread held the
    runtime's thread-state lock (gh-112275): inside os.fork(), before any of torch's worker code."""
    if _HANG_NEXT_FORKS[0] > 0:
        time.sleep(3600)


def _count_fork():
    _HANG_NEXT_FORKS[0] = max(_HANG_NEXT_FORKS[0] - 1, 0)


os.register_at_fork(after_in_child=_signal_self_at_birth)
os.register_at_fork(after_in_child=_hang_at_birth, after_in_parent=_count_fork)


def _loader(fmt, fm_tree, fm_wds):
    path = fm_tree if fmt == "imagefolder" else fm_wds
    d = DataConfig(format=fmt, train_path=str(path), val_path=str(path), num_workers=2, repeated_aug=1)
    return build_loader(d, LoaderSpec("val", 32, 25))


def _same(got, want):
    return len(got) == len(want) and all(torch.equal(a, c) and torch.equal(b, e) for (a, b), (c, e) in zip(got, want))


@pytest.mark.parametrize("fmt", ["imagefolder", "wds"])
def test_workers_ignore_stop_signals_from_others_and_the_epoch_continues(fmt, fm_tree, fm_wds):
    loader = _loader(fmt, fm_tree, fm_wds)
    want = list(loader.epoch(0))
    others = {p.pid for p in psutil.Process().children()}  # processes left by earlier tests are not ours
    got, killed = [], []
    for x, y in loader.epoch(0):
        got.append((x, y))
        if not killed:
            workers = [p.pid for p in psutil.Process().children() if p.pid not in others]
            assert len(workers) == 2
            for sig in ("TERM", "USR1", "INT"):  # sent by another process, as slurmstepd does
                subprocess.run(["kill", f"-{sig}", *map(str, workers)], check=True)
            killed = workers
            psutil.wait_procs([psutil.Process(p) for p in workers], timeout=0.5)  # a killed one would be reported
    assert killed and len(want) == len(loader) and _same(got, want)


def test_a_signal_at_the_instant_of_the_fork_does_not_kill_a_worker(fm_tree, fm_wds):
    loader = _loader("imagefolder", fm_tree, fm_wds)
    want = list(loader.epoch(0))
    batches = loader.epoch(0)
    _AT_BIRTH[:] = [signal.SIGTERM, signal.SIGUSR1, signal.SIGINT]
    try:
        got = [next(batches)]  # starts both workers; each signals itself before any of torch's code runs
    finally:
        _AT_BIRTH.clear()
    got += list(batches)
    assert _same(got, want)


class _WorkerState(Dataset):
    def __len__(self):
        return 2

    def __getitem__(self, i):
        blocked = signal.pthread_sigmask(signal.SIG_BLOCK, [])
        return {"then": os.environ.get("WORKER_THEN"), "term_blocked": signal.SIGTERM in blocked,
                "usr1": signal.getsignal(signal.SIGUSR1) == signal.SIG_IGN,
                "int": signal.getsignal(signal.SIGINT) == signal.SIG_IGN}


def _then(worker_id):
    os.environ["WORKER_THEN"] = f"worker {worker_id}"


def test_worker_init_fn_composes_and_the_worker_state_is_as_documented():
    loader = DataLoader(_WorkerState(), batch_size=None, num_workers=1, worker_init_fn=worker_init_fn(_then),
                        multiprocessing_context="spawn")  # spawn pickles the init function
    states = list(iterate(loader))
    assert states == [{"then": "worker 0", "term_blocked": True, "usr1": True, "int": True}] * 2
    assert signal.SIGTERM not in signal.pthread_sigmask(signal.SIG_BLOCK, [])  # the main process's mask is back


def test_an_unfinished_epoch_does_not_hang_the_exit(fm_tree):
    """The interpreter's exit terminate()s live workers (an exception left the epoch's iterator unclosed)."""
    script = textwrap.dedent(f"""
        from convit_scale.config import DataConfig
        from convit_scale.data import LoaderSpec, build_loader
        d = DataConfig(format="imagefolder", train_path={str(fm_tree)!r}, val_path={str(fm_tree)!r}, num_workers=2)
        batches = build_loader(d, LoaderSpec("val", 32, 25)).epoch(0)
        next(batches)
        print("one batch", flush=True)
    """)
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and "one batch" in out.stdout, out.stderr


def test_workers_are_forked_by_the_training_process_whatever_the_default_start_method(fm_tree):
    """Under forkserver (Python 3.14's default on Linux; here set, and its server started before any loader) the
    package's workers are still the training process's own children, born with the stop signals blocked; a loader
    whose workers a forkserver would make is refused."""
    script = textwrap.dedent(f"""
        import multiprocessing, multiprocessing.forkserver, os, psutil
        multiprocessing.set_start_method("forkserver")
        multiprocessing.forkserver.ensure_running()
        from convit_scale.config import DataConfig
        from convit_scale.data import LoaderSpec, build_loader
        d = DataConfig(format="imagefolder", train_path={str(fm_tree)!r}, val_path={str(fm_tree)!r}, num_workers=2)
        batches = build_loader(d, LoaderSpec("val", 32, 25)).epoch(0)
        next(batches)
        me = psutil.Process()
        print("own workers", sum(p.ppid() == me.pid and p.cmdline() == me.cmdline() for p in me.children(True)))
        batches.close()
    """)
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and "own workers 2" in out.stdout, (out.stdout, out.stderr[-2000:])
    assert loader_options(0, 0, 0)["multiprocessing_context"] is None  # torch refuses one without workers
    forkserver = DataLoader(_WorkerState(), batch_size=None, num_workers=1, multiprocessing_context="forkserver")
    with pytest.raises(ValueError, match="forkserver"):
        next(iterate(forkserver))


@pytest.fixture
def quick_start_checks(monkeypatch):
    """A 1 s wait for a worker's first line (20 s in training), and torch's 5 s join of a worker that does not
    exit cut to 0.5 s."""
    from torch.utils.data import _utils

    monkeypatch.setattr(workers, "START_TIMEOUT_S", 1.0)
    monkeypatch.setattr(_utils, "MP_STATUS_CHECK_INTERVAL", 0.5)
    yield
    _HANG_NEXT_FORKS[0] = 0


@pytest.mark.parametrize("fmt", ["imagefolder", "wds"])
def test_a_worker_whose_fork_hangs_is_killed_and_the_epochs_workers_started_again(fmt, fm_tree, fm_wds, caplog,
                                                                                  quick_start_checks):
    """Before: the main process waited for the hung worker's batch for ever (an epoch-end analysis of a 2-rank run,
    until the collective timeout ended the job)."""
    loader = _loader(fmt, fm_tree, fm_wds)
    want = list(loader.epoch(0))
    _HANG_NEXT_FORKS[0] = 1  # the first of the epoch's two workers
    with caplog.at_level(logging.WARNING, logger="convit_scale.data.workers"):
        got = list(loader.epoch(0))
    assert _same(got, want)
    (line,) = [r.getMessage() for r in caplog.records if "did not start" in r.getMessage()]
    assert "did not start within 1 s" in line and "attempt 2 of 3" in line, line
    pid = int(re.search(r"worker\(s\) (\d+) ", line).group(1))
    assert not psutil.pid_exists(pid)  # killed and reaped


def test_workers_that_never_start_end_the_epoch_with_an_error_and_leave_no_process(quick_start_checks):
    """An error of the machine, not a DataError (which ends a Slurm job without a restart: bad input)."""
    loader = DataLoader(_WorkerState(), batch_size=None, **loader_options(1, 0, 0))
    before = {p.pid for p in psutil.Process().children()}
    _HANG_NEXT_FORKS[0] = 3
    with pytest.raises(workers.WorkerStartError,
                       match=r"DataLoader workers did not start within 1 s, 3 times \(last: pid \d+\)"):
        next(iterate(loader))
    assert not issubclass(workers.WorkerStartError, DataError)
    assert {p.pid for p in psutil.Process().children()} <= before
    assert list(iterate(loader))  # the next epoch's workers start


def test_a_worker_init_made_for_fewer_workers_is_refused_before_any_start():
    """Its worker 1 would fail to mark itself (torch keeps an init's exception for the first batch) and be taken
    for a hung fork."""
    loader = DataLoader(_WorkerState(), batch_size=None, num_workers=2, worker_init_fn=worker_init_fn(),
                        multiprocessing_context="fork")
    with pytest.raises(ValueError, match=r"made for 1 worker\(s\), the DataLoader starts 2"):
        next(iterate(loader))
