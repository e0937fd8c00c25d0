"""Stop signals: Slurm's pre-timeout signal, a preemption, scancel."""

from __future__ import annotations

import signal
import threading

from ..runfolder import EXIT_HANG, EXIT_REQUEUE  # the run folder's protocol: the launcher reads them too

__all__ = ["EXIT_HANG", "EXIT_REQUEUE", "StopSignal"]


class StopSignal:
    """Set by SIGUSR1 / SIGTERM; read once per step, inside the step's one reduction, so that every rank stops
    after the same step."""

    def __init__(self):
        self.signum: int | None = None
        if threading.current_thread() is not threading.main_thread():
            raise RuntimeError("training in this process must run in its main thread, the only one that can take "
                               "the stop signals (SIGUSR1/SIGTERM) that save and requeue; from another thread, "
                               "train in a child process (run_recipe without in_process)")
        self._previous = {s: signal.signal(s, self._handler) for s in (signal.SIGUSR1, signal.SIGTERM)}

    def restore(self) -> None:
        """Put back the handlers that were there before (a library caller keeps its own)."""
        for s, handler in self._previous.items():
            signal.signal(s, handler)

    def _handler(self, signum, frame):
        self.signum = signum

    @property
    def requested(self) -> bool:
        return self.signum is not None
