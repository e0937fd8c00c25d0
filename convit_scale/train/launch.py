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


PROBE_TIMEOUT_S = 10
"""How long preflight waits for a remote WebDataset location's manifest.json before refusing the URL."""


def preflight(cfg) -> None:
    """Checks that must pass before any worker process starts, each one line naming the key and what is allowed.

    Cheap by design (manifest.json and file sizes, no image is read): the output folder can be written; the data
    exists in the recipe's format, holds at least one global batch and no more classes than the model has, and
    every file the manifest lists is there at its recorded size; a remote location answers; ``model.pretrained``
    matches the model key for key (on the meta device); a checkpoint to resume was written by the same model,
    strategy and global batch; the teacher loads."""
    from ..data import DataError
    from ..metrics import check_log_backends

    d = cfg.data
    _check_output_dir(cfg.run.output_dir)
    for key in ("train_path", "val_path"):
        loc = getattr(d, key)
        if key == "train_path" and not loc:
            raise DataError("data.train_path is empty: point it at prepared shards or an ImageFolder tree")
        if loc and "{name}" not in loc and not Path(loc).exists():
            raise DataError(f"data.{key}: {loc} does not exist")
    for split, key in (("train", "train_path"), ("val", "val_path")):
        if getattr(d, key):
            _check_data(cfg, split, key, getattr(d, key))
    check_log_backends(cfg.log)  # log.tensorboard / log.wandb without their package
    if cfg.model.pretrained:
        _check_pretrained(cfg.model)
    if cfg.checkpoint.resume != "none":
        _check_resume(cfg)
    if cfg.distill.enabled:
        from .distill import build_teacher

        build_teacher(cfg)


def _check_output_dir(output_dir: str) -> None:
    """run.output_dir is a folder, or can be made one, and a file can be written in it (or its first existing
    parent): nothing is created here."""
    out = Path(output_dir)
    allowed = "allowed: a folder that can be created and written"
    existing = next(p for p in (out, *out.parents) if p.exists() or p == Path(p.anchor or "."))
    if not existing.is_dir():
        raise ValueError(f"run.output_dir = {output_dir}: {existing} is a file, not a folder; {allowed}")
    try:
        import tempfile

        with tempfile.TemporaryFile(dir=existing):  # unnamed, gone when closed
            pass
    except OSError as e:
        raise ValueError(f"run.output_dir = {output_dir}: cannot write in {existing} ({e.strerror}); {allowed}") from e


def _probe_remote(key: str, loc: str) -> dict:
    """A remote WebDataset location's manifest.json within PROBE_TIMEOUT_S: a wrong URL is one line now, not a
    minute of silence per rank later."""
    import json
    import urllib.request

    from ..data import DataError, read_manifest

    url = loc.format(name="manifest.json")
    try:
        if url.startswith("pipe:"):
            res = subprocess.run(url[len("pipe:"):], shell=True, capture_output=True, timeout=PROBE_TIMEOUT_S)
            if res.returncode != 0:
                why = (res.stderr.decode(errors="replace").strip().splitlines() or [f"exit status {res.returncode}"])
                raise DataError(f"data.{key}: {url} failed ({why[-1]}); allowed: a location whose manifest.json reads")
            data = res.stdout
        elif url.startswith(("http://", "https://")):
            with urllib.request.urlopen(url, timeout=PROBE_TIMEOUT_S) as f:
                data = f.read()
        else:
            return read_manifest(loc)
        return json.loads(data)
    except subprocess.TimeoutExpired as e:
        raise DataError(f"data.{key}: {url} gave no answer within {PROBE_TIMEOUT_S} s; allowed: a reachable "
                        f"location of prepared shards") from e
    except (OSError, ValueError) as e:  # URLError, a timeout, JSON that is not
        raise DataError(f"data.{key}: {url} is not readable ({getattr(e, 'reason', e)}); allowed: a reachable "
                        f"location of prepared shards with manifest.json") from e


def _check_data(cfg, split: str, key: str, loc: str) -> None:
    """The data of one split against the recipe, from manifest.json and file sizes (ImageFolder: the listing)."""
    import math

    from data_prep import PrepError

    from ..data import DataError, read_manifest

    d, model = cfg.data, cfg.model
    if d.format == "imagefolder":
        from ..data.imagefolder import imagefolder_samples
        from convit_scale.imagetree import list_classes

        root = Path(loc)
        if not (root / split).is_dir():
            held = (" (it holds a prepared dataset: set data.format to the manifest's format)"
                    if (root / "manifest.json").is_file() else "")
            raise DataError(f"data.{key}: no {split} folder in {root}{held}; allowed: an ImageFolder root with "
                            f"train/ and val/")
        try:
            n_classes = len(list_classes(root / "train"))
            n = len(imagefolder_samples(root, split, d.subset_fraction)) if split == "train" else None
        except PrepError as e:
            raise DataError(f"data.{key}: {e}") from e
    else:
        remote = "{name}" in loc
        manifest = _probe_remote(key, loc) if remote else read_manifest(loc)
        found = manifest.get("format")
        if found != d.format:
            raise DataError(f"data.{key}: {loc} holds {found} data (manifest.json), data.format = {d.format!r}; "
                            f"allowed: data.format = {found!r}, or {d.format} data made by `convit-scale prep {d.format}`")
        if split not in manifest.get("splits", {}):
            raise DataError(f"data.{key}: {loc}: manifest has no {split!r} split; allowed: a prep output with {split}/")
        info, n_classes = manifest["splits"][split], len(manifest["classes"])
        prepared_f = manifest.get("options", {}).get("subset_fraction", 1.0)
        if split == "train" and d.format == "wds" and not math.isclose(prepared_f, d.subset_fraction):
            raise DataError(f"{loc}: shards hold subset_fraction={prepared_f}, the recipe asks {d.subset_fraction}; "
                            f"convert with `convit-scale prep wds --subset-fraction {d.subset_fraction}` (WebDataset "
                            f"subsets are made at conversion)")
        if split == "train" and d.format == "ffcv":  # the subset is taken at load time: first files of each class
            n = sum(math.floor(c * d.subset_fraction) for c in info["per_class"].values())
        else:
            n = info["num_samples"] if split == "train" else None
        for name, rec in ([] if remote else info["files"].items()):
            path = Path(loc) / name
            if not path.is_file():
                raise DataError(f"data.{key}: {path} is missing (listed in manifest.json); allowed: the complete "
                                f"output of `convit-scale prep` (run it again to finish it)")
            size, recorded = path.stat().st_size, rec.get("bytes")
            if recorded is not None and size != recorded:
                raise DataError(f"data.{key}: {path} has {size} bytes, manifest.json records {recorded} (truncated or "
                                f"changed); allowed: the file prep wrote (check with `convit-scale prep verify {loc}`)")
    if n_classes > model.num_classes:
        raise DataError(f"model.num_classes = {model.num_classes} is below the {n_classes} classes of {loc}; allowed: "
                        f">= {n_classes}")
    if n is not None and n < d.global_batch_size:
        raise DataError(f"data.{key}: {loc} holds {n} training images (subset_fraction {d.subset_fraction:g}), fewer "
                        f"than data.global_batch_size = {d.global_batch_size}: no optimizer step fits in an epoch; "
                        f"allowed: data.global_batch_size <= {n}")


def _check_pretrained(m) -> None:
    """model.pretrained holds the model's keys and shapes, checked against a model on the meta device."""
    from ..config import model_options
    from ..models import create_model, read_state_dict
    from ..models.weights import check_state_dict, convert_state_dict

    model = create_model(m.name, device="meta", **model_options(m))
    sd = convert_state_dict(read_state_dict(m.pretrained), model)
    check_state_dict(sd, model, f"model.pretrained {m.pretrained} ({m.name})")


def _check_resume(cfg) -> None:
    """The checkpoint that checkpoint.resume picks was written by this recipe's model, strategy and global batch
    (the same check the engine makes, here before any process starts or anything is written)."""
    from .checkpoint import check_compatible, latest_checkpoint, read_meta

    resume = cfg.checkpoint.resume
    path = latest_checkpoint(Path(cfg.run.output_dir) / "checkpoints") if resume == "auto" else Path(resume)
    if path is not None:
        check_compatible(path, read_meta(path), {"strategy": cfg.parallel.strategy, "model": cfg.model.name,
                                                 "global_batch_size": cfg.data.global_batch_size})


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
           "PET_SHUTDOWN_TIMEOUT": os.environ.get("STOP_GRACE_S", "300"),
           # Slurm may signal torchrun itself with USR1 (the whole step is signalled): torch >= 2.9 then forwards it
           "PET_SIGNALS_TO_HANDLE": "SIGTERM,SIGINT,SIGHUP,SIGQUIT,SIGUSR1", **(env or {})}
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
    from ..models.weights import CheckpointMismatch
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
