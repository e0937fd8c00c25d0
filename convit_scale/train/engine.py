"""Training one rank: the process group, ``setup``, ``fit``, and the outcome as the process's exit status.

A run, in order: ``setup`` (setup.py: global batch -> resume point -> loaders -> model -> strategy -> loss ->
resume), then ``fit`` (loop.py): epochs of ``train_step`` (step.py: micro-batches, one packed reduction, the
non-finite decision before the update), ``log_step``, periodic checkpoints, ``close_epoch`` (evaluation, analysis,
checkpoint), and a final checkpoint. A stop signal makes every rank finish its step and save; ``train`` then
returns ``"stopped"`` and :func:`exit_status` turns it into ``EXIT_REQUEUE``: the library never exits the process.
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

from .. import comm
from ..config import Config
from ..data import DataError
from ..errors import BadInput, message
from ..manifest import SourceUnavailable
from ..runfolder import EXIT_BAD_INPUT, EXIT_NONFINITE, EXIT_STORAGE, FolderHeld, release_lease
from .distributed import init_distributed, set_flight_recorder
from .integrity import StorageError
from .loop import fit, settle_saves
from .setup import log, setup
from .signals import EXIT_REQUEUE, StopSignal
from .step import NonFiniteLoss
from .watchdog import Watchdog, collective_failure, long_collective_timeout_s


class SetupRefused(BadInput):
    """The run cannot start as configured (data, checkpoint, world size): a one-line reason, nothing trained."""


def _watchdog(cfg: Config) -> Watchdog:
    """This rank's watchdog, started before the process group forms (a rendezvous that never completes is a hang
    too): rank and world size as the launcher set them. With fault.enabled false it only records the phases."""
    env = os.environ
    rank = int(env.get("RANK", env.get("SLURM_PROCID", "0")))
    world = int(env.get("WORLD_SIZE", env.get("SLURM_NTASKS", "1")))
    return Watchdog.for_run(cfg.fault, Path(cfg.run.output_dir), rank, world).start()


def _outcome(e: BaseException) -> str:
    """How a rank ended, for its last heartbeat (the launcher's diagnosis reads it: an OutOfMemoryError is an OOM)."""
    first = next((line for line in message(e).splitlines() if line.strip()), "")
    return f"failed: {type(e).__name__}: {first[:300]}"


def train(cfg: Config) -> str:
    """Run the recipe on this rank; returns "finished" or "stopped" (after a stop signal, saved)."""
    stop, watch, outcome = StopSignal(), _watchdog(cfg), "ended"
    try:
        set_flight_recorder(cfg.fault.nccl_trace_entries)  # before the process group: NCCL reads it then
        ctx = init_distributed(cfg.parallel.backend, int(long_collective_timeout_s(cfg.parallel, cfg.fault)))
    except BaseException as e:
        watch.stop(_outcome(e))
        stop.restore()
        raise
    try:
        watch.backend = ctx.backend
        if cfg.fault.enabled:
            log(ctx, watch.describe())
        try:
            run, state = setup(cfg, ctx, stop, watch)
        except SourceUnavailable:
            raise
        except (BadInput, FolderHeld, FileNotFoundError) as e:  # anything else is a bug: a crash the launcher restarts
            raise SetupRefused(str(e)) from e
        try:
            outcome = fit(run, state)
            return outcome
        finally:
            settle_saves(run, failing=sys.exc_info()[1] is not None)
            run.metrics.close()
            run.strategy.close()
    except BaseException as e:
        outcome = _outcome(e)
        if collective_failure(e):  # the others' stacks before the launcher ends them: where the culprit was
            watch.request_stacks(f"a collective failed on it: {outcome[len('failed: '):][:200]}")
            watch.stop(outcome)  # its own watchdog must not report a hang of this rank while it waits for them
            time.sleep(2 * watch.tick + 0.5)
        raise
    finally:
        watch.stop(outcome)
        stop.restore()
        release_lease(Path(cfg.run.output_dir))  # only the process holding it (rank 0) removes it
        if ctx.owns_group:
            comm.destroy()  # alone: also the one-process group's launch variables (init_distributed)


def exit_status(cfg: Config) -> int:
    """Train this rank and map the outcome to the process's exit status: 0 finished, ``EXIT_REQUEUE`` stopped and
    saved, ``EXIT_NONFINITE``, ``EXIT_STORAGE`` (a save that did not fit or was refused by the file system) or
    ``EXIT_BAD_INPUT``, each with one ``error:`` line."""
    try:
        status = train(cfg)
    except NonFiniteLoss as e:
        print(f"error: {message(e)}", file=sys.stderr)
        return EXIT_NONFINITE
    except StorageError as e:
        print(f"error: {message(e)}", file=sys.stderr)
        return EXIT_STORAGE
    except SourceUnavailable as e:  # the data may come back: a crash to the launcher (restarted after progress)
        print(f"error: {message(e)}", file=sys.stderr)
        return 1
    except (SetupRefused, DataError) as e:  # DataError: data that failed during training (max_bad_samples, a shard)
        print(f"error: {message(e)}", file=sys.stderr)
        return EXIT_BAD_INPUT
    return EXIT_REQUEUE if status == "stopped" else 0


__all__ = ["train", "exit_status", "setup", "fit", "EXIT_REQUEUE", "EXIT_BAD_INPUT", "EXIT_NONFINITE", "EXIT_STORAGE",
           "NonFiniteLoss", "SetupRefused", "StorageError"]
