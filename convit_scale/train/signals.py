"""Stop signals: Slurm's pre-timeout signal, a preemption, scancel."""

from __future__ import annotations

import signal
import threading

from ..runfolder import EXIT_HANG, EXIT_REQUEUE  # the run folder's protocol: the launcher reads them too

__all__ = ["EXIT_HANG", "EXIT_REQUEUE", "StopSignal", "catch_early"]

STOP_SIGNALS = (signal.SIGUSR1, signal.SIGTERM)
_EARLY: list[int] = []
"""Stop signals this process received before its ``StopSignal`` existed (``catch_early``)."""


def catch_early() -> None:
    """A rank's first act (``python -m convit_scale.train``): SIGUSR1 is recorded from now on instead of ending the
    process (its default action), through the seconds of imports, and of rank 0's preflight, before training
    installs ``StopSignal``, which takes it over. Slurm sends its pre-timeout signal once: a rank started just before
    it (a restart in the job's last minutes) stops after its first step with a checkpoint instead of dying of it.
    SIGTERM keeps its default until then: it is also how a launcher ends the ranks of a start that failed, which
    must not wait for them to reach training."""
    signal.signal(signal.SIGUSR1, _record_early)


def _record_early(signum, frame):
    _EARLY.append(signum)


class StopSignal:
    """Set by SIGUSR1 / SIGTERM (or by one ``catch_early`` recorded before it); read once per step, inside the step's
    one reduction, so that every rank stops after the same step."""

    def __init__(self):
        self.signum: int | None = _EARLY[-1] if _EARLY else None
        _EARLY.clear()
        if threading.current_thread() is not threading.main_thread():
            raise RuntimeError("training in this process must run in its main thread, the only one that can take "
                               "the stop signals (SIGUSR1/SIGTERM) that save and requeue; from another thread, "
                               "train in a child process (run_recipe without in_process)")
        self._previous = {s: signal.signal(s, self._handler) for s in STOP_SIGNALS}

    def restore(self) -> None:
        """Put back the handlers that were there before (a library caller keeps its own). In a rank, SIGUSR1 stays
        recorded, not fatal, until it exits: Slurm's pre-timeout signal as a run ends must not turn its exit 0 into a
        death by a signal; SIGTERM ends it (the default), as a launcher ending it expects."""
        for s, handler in self._previous.items():
            signal.signal(s, handler)

    def _handler(self, signum, frame):
        self.signum = signum

    @property
    def requested(self) -> bool:
        return self.signum is not None
