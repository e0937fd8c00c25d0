"""Stop signals (convit_scale/train/signals.py): SIGUSR1 (Slurm's warning before the time limit) and SIGTERM
(preemption, scancel) are recorded, not fatal; the handlers that were there before come back."""

from __future__ import annotations

import os
import signal

import pytest

from convit_scale.train.signals import StopSignal


@pytest.mark.parametrize("signum", [signal.SIGUSR1, signal.SIGTERM])
def test_a_signal_is_recorded_and_the_previous_handlers_restored(signum):
    seen = []
    before = {s: signal.signal(s, lambda n, f: seen.append(n)) for s in (signal.SIGUSR1, signal.SIGTERM)}
    try:
        stop = StopSignal()
        assert not stop.requested
        os.kill(os.getpid(), signum)  # delivered to the main thread before kill returns
        assert stop.requested and stop.signum == signum and seen == []
        stop.restore()
        os.kill(os.getpid(), signum)
        assert seen == [signum]  # the caller's own handler again
    finally:
        for s, handler in before.items():
            signal.signal(s, handler)



def test_outside_the_main_thread_the_refusal_says_how_to_train_there():
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(1) as pool, pytest.raises(RuntimeError, match="main thread.*child process"):
        pool.submit(StopSignal).result()


def test_a_stop_signal_during_a_ranks_imports_is_kept_for_training():
    """A rank's first act records SIGUSR1 (Slurm's pre-timeout signal; its default would end it): one sent while it
    imports, before training installs its handler, is that handler's from the start; after training it is still
    recorded (a run that finished exits 0), while SIGTERM ends the process (the default), as its launcher expects."""
    import subprocess
    import sys

    probe = ("import os, signal\n"
             "from convit_scale.train import signals\n"
             "signals.catch_early()\n"
             "assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL\n"
             "os.kill(os.getpid(), signal.SIGUSR1)  # during the imports that follow, in a rank\n"
             "import torch  # noqa: F401\n"
             "stop = signals.StopSignal()\n"
             "assert stop.requested and stop.signum == signal.SIGUSR1\n"
             "assert not signals.StopSignal().requested  # taken once\n"
             "stop.restore()\n"
             "os.kill(os.getpid(), signal.SIGUSR1)  # as the run ends\n"
             "print('kept', flush=True)\n"
             "os.kill(os.getpid(), signal.SIGTERM)\n"
             "print('not reached')\n")
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True)
    assert done.returncode == -signal.SIGTERM and done.stdout == "kept\n", done.stderr[-2000:]


def test_a_rank_catches_stop_signals_before_its_imports():
    """``python -m convit_scale.train`` calls ``catch_early`` before it imports the package's heavy modules."""
    import ast
    from pathlib import Path

    import convit_scale.train

    tree = ast.parse((Path(convit_scale.train.__file__).parent / "__main__.py").read_text())
    guard = next(n for n in tree.body if isinstance(n, ast.If) and "__main__" in ast.unparse(n.test))
    later = [n for n in tree.body[tree.body.index(guard):] if isinstance(n, ast.ImportFrom)]
    assert ast.unparse(guard.body[0]) == "catch_early()" and {n.module for n in later} >= {"config", "engine"}
