"""Start a recipe: ``python -m convit_scale.train`` (:func:`main`), the checks that run before any process starts, and "this recipe on N local processes".

Every entry point goes through here: ``convit-scale train``, the demo, the experiments and the benchmarks
call :func:`run_recipe`; ``python -m convit_scale.train`` (torchrun, srun, accelerate) runs
:func:`preflight` on rank 0 before the process group forms.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path


def preflight(cfg) -> None:
    """Checks that must pass before any worker process starts: data present, teacher file loads."""
    from ..data import DataError

    d = cfg.data
    for key in ("train_path", "val_path"):
        loc = getattr(d, key)
        if key == "train_path" and not loc:
            raise DataError("data.train_path is empty: point it at prepared shards or an ImageFolder tree")
        if loc and "{name}" not in loc and not Path(loc).exists():
            raise DataError(f"data.{key}: {loc} does not exist")
    if d.format == "wds":
        # the manifest alone: splits present, subset made at conversion matches the recipe's
        from ..data import LoaderSpec
        from ..data.wds import WdsLoader

        for split, loc in (("train", d.train_path), ("val", d.val_path)):
            if loc and "://" not in loc:
                WdsLoader(d, LoaderSpec(split, 32, 1))
    if cfg.log.tensorboard:
        try:
            import tensorboard  # noqa: F401
        except ImportError as e:
            raise ValueError("log.tensorboard = true needs the tensorboard package: pip install tensorboard") from e
    if cfg.distill.enabled:
        from .distill import build_teacher

        build_teacher(cfg)


def launch_torchrun(train_args: list[str], nproc: int, env: dict | None = None, quiet: bool = False,
                    marker: Path | None = None) -> int:
    """Start ``nproc`` local ranks of ``python -m convit_scale.train TRAIN_ARGS`` with torchrun (static
    rendezvous on a free port) and wait for them.

    torchrun runs in a session of its own, and this process passes each SIGTERM/SIGUSR1 on to it once, as SIGTERM
    (which every torch release forwards to its ranks): a signal sent to this process alone or to its whole process
    group (Slurm, ``kill -TERM -- -PGID``) reaches every rank exactly once, and the ranks finish their step and
    save. torchrun's own exit status after such a stop is not 75, so a requeue marker written during this run
    (``marker``, removed before the start) turns it into ``EXIT_REQUEUE``."""
    import signal
    import time

    from .distributed import free_port

    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={nproc}", "--nnodes=1",
           "--master-addr=127.0.0.1", f"--master-port={free_port()}", "-m", "convit_scale.train",
           *train_args]
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1"),
           "PET_SHUTDOWN_TIMEOUT": os.environ.get("STOP_GRACE_S", "300"), **(env or {})}
    if marker is not None:
        marker.unlink(missing_ok=True)
    out = subprocess.DEVNULL if quiet else None
    started = time.time()
    proc = subprocess.Popen(cmd, env=env, stdout=out, stderr=out, start_new_session=True)
    forward = {s: signal.signal(s, lambda signum, frame: proc.send_signal(
        signal.SIGINT if signum == signal.SIGINT else signal.SIGTERM)) for s in (signal.SIGTERM, signal.SIGUSR1,
                                                                                 signal.SIGINT)}
    try:
        rc = proc.wait()
    finally:
        for s, handler in forward.items():
            signal.signal(s, handler)
    if rc != 0 and marker is not None and marker.is_file() and marker.stat().st_mtime >= started - 1:
        from .engine import EXIT_REQUEUE

        return EXIT_REQUEUE
    return rc


def run_recipe(recipe: str | Path, overrides: list[str], nproc: int = 1, env: dict | None = None,
               in_process: bool = False, checked: bool = False, quiet: bool = False) -> int:
    """Train ``recipe`` with ``overrides`` on ``nproc`` local processes; returns the exit status.

    nproc > 1 starts torchrun (static rendezvous on a free port). nproc == 1 runs in this process when
    ``in_process`` (no second interpreter) and otherwise in a child process, so that a library caller keeps
    its own state. ``checked``: the caller has already run :func:`preflight` on this recipe."""
    if nproc < 1:
        raise ValueError(f"nproc = {nproc}: the number of local processes must be at least 1")
    args = (["--no-preflight"] if checked else []) + ["--recipe", str(recipe), *overrides]
    if nproc > 1:  # what needs the world size is refused here, before torchrun starts any rank
        from ..config import load_config
        from .distributed import check_world

        cfg = load_config(recipe, overrides)
        check_world(cfg, nproc)
        return launch_torchrun(args, nproc, env=env, quiet=quiet,
                               marker=Path(cfg.run.output_dir) / "STOPPED_FOR_REQUEUE")
    if in_process and not env:
        return main(args)
    out = subprocess.DEVNULL if quiet else None
    return subprocess.call([sys.executable, "-m", "convit_scale.train", *args], env={**os.environ, **(env or {})},
                           stdout=out, stderr=out)


def _launch_rank() -> int:
    """This process's rank as the launcher set it, before any process group exists."""
    return int(os.environ.get("RANK", os.environ.get("SLURM_PROCID", "0")))


def main(argv: list[str] | None = None) -> int:
    import argparse

    from ..config import ConfigError, find_recipe, load_config
    from ..data import DataError
    from ..models.checkpoints import CheckpointMismatch
    from .distributed import check_launcher_env
    from .engine import EXIT_REQUEUE, NonFiniteLoss, SetupRefused, train

    parser = argparse.ArgumentParser(prog="python -m convit_scale.train")
    parser.add_argument("--recipe", required=True)
    parser.add_argument("--no-preflight", action="store_true",
                        help="skip the start-up checks (the launching process has run them)")
    parser.add_argument("overrides", nargs="*")
    args = parser.parse_args(argv)
    try:
        cfg = load_config(find_recipe(args.recipe), args.overrides)
        check_launcher_env(cfg.parallel.strategy, cfg.parallel.precision)
        if not args.no_preflight and _launch_rank() == 0:  # before the process group: the other ranks
            preflight(cfg)                                  # wait at the rendezvous and are stopped with it
    except (ConfigError, DataError, CheckpointMismatch, FileNotFoundError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    try:
        status = train(cfg)
    except NonFiniteLoss as e:
        print(f"error: {e}", file=sys.stderr)
        return 3
    except SetupRefused as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except DataError as e:  # data that failed during training (past data.max_bad_samples, a shard never opened)
        print(f"error: {e}", file=sys.stderr)
        return 2
    return EXIT_REQUEUE if status == "stopped" else 0
