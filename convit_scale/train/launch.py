"""Start a recipe on N local processes: "this recipe on N processes" for ``convit-scale train``, the demo, the
experiments and the benchmarks.

The launching process validates the recipe once (the caller's ``load_config``), runs :func:`preflight` once, and
writes the resolved config into the run folder; with more than one process, torchrun's ranks load that file
(``python -m convit_scale.train --config RUN/config.yaml``) instead of parsing and checking the recipe again.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

from ..config import Config
from ..errors import BadInput
from ..runfolder import STOPPED_FOR_REQUEUE
from .distributed import check_world, free_port
from .engine import exit_status
from .preflight import preflight
from .setup import write_resolved
from .signals import EXIT_REQUEUE

__all__ = ["launch_torchrun", "run_recipe", "write_resolved"]


def launch_torchrun(train_args: list[str], nproc: int, env: dict | None = None, quiet: bool = False,
                    marker: Path | None = None) -> int:
    """Start ``nproc`` local ranks of ``python -m convit_scale.train TRAIN_ARGS`` with torchrun (static
    rendezvous on a free port) and wait for them.

    torchrun runs in a session of its own, and this process passes each SIGTERM/SIGUSR1 on to it once, as SIGTERM
    (which every torch release forwards to its ranks): a signal sent to this process alone or to its whole process
    group (Slurm, ``kill -TERM -- -PGID``) reaches every rank exactly once, and the ranks finish their step and
    save. torchrun's own exit status after such a stop is not 75, so a requeue marker written during this run
    (``marker``, removed before the start) turns it into ``EXIT_REQUEUE``."""
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={nproc}", "--nnodes=1",
           "--master-addr=127.0.0.1", f"--master-port={free_port()}", "-m", "convit_scale.train", *train_args]
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1"),
           "PET_SHUTDOWN_TIMEOUT": os.environ.get("STOP_GRACE_S", "240"),
           # Slurm may signal torchrun itself with USR1 (the whole step is signalled): torch >= 2.9 then forwards it
           "PET_SIGNALS_TO_HANDLE": "SIGTERM,SIGINT,SIGHUP,SIGQUIT,SIGUSR1", **(env or {})}
    if marker is not None:
        marker.unlink(missing_ok=True)
    out = subprocess.DEVNULL if quiet else None
    started = time.time()
    # Only the main thread may set handlers: a torchrun started from another thread (runs trained side by side)
    # stays in this process group instead, where a signal to the group (Ctrl-C, Slurm, kill -- -PGID) reaches it.
    main = threading.current_thread() is threading.main_thread()
    proc = subprocess.Popen(cmd, env=env, stdout=out, stderr=out, start_new_session=main)
    forward = {s: signal.signal(s, lambda signum, frame: proc.send_signal(
        signal.SIGINT if signum == signal.SIGINT else signal.SIGTERM)) for s in (signal.SIGTERM, signal.SIGUSR1,
                                                                                 signal.SIGINT)} if main else {}
    try:
        rc = proc.wait()
    finally:
        for s, handler in forward.items():
            signal.signal(s, handler)
    if rc != 0 and marker is not None and marker.is_file() and marker.stat().st_mtime >= started - 1:
        return EXIT_REQUEUE
    return rc


def run_recipe(cfg: Config, nproc: int = 1, env: dict | None = None, in_process: bool = False,
               quiet: bool = False) -> int:
    """Train the validated config ``cfg`` on ``nproc`` local processes; returns the exit status.

    The preflight and the checks that need the world size run here, once, before any process starts. nproc > 1
    starts torchrun (static rendezvous on a free port). nproc == 1 runs in this process when ``in_process`` (no
    second interpreter) and otherwise in a child process, so that a library caller keeps its own state."""
    if nproc < 1:
        raise BadInput(f"nproc = {nproc}: the number of local processes must be at least 1")
    preflight(cfg)
    check_world(cfg, nproc)
    if nproc == 1 and in_process and not env:
        return exit_status(cfg)
    args = ["--config", str(write_resolved(cfg))]
    if nproc > 1:
        return launch_torchrun(args, nproc, env=env, quiet=quiet,
                               marker=Path(cfg.run.output_dir) / STOPPED_FOR_REQUEUE)
    out = subprocess.DEVNULL if quiet else None
    return subprocess.call([sys.executable, "-m", "convit_scale.train", *args], env={**os.environ, **(env or {})},
                           stdout=out, stderr=out)
