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
