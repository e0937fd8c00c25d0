"""Checkpoints: written under a temporary name and published by an atomic rename.

Layout: ``<output_dir>/checkpoints/step_000001234/`` holding the strategy's sharded state (DCP for
DDP/FSDP2, DeepSpeed's own for ZeRO), ``rng_rank<R>.pt`` per rank and ``meta.json`` (step, epoch,
position in the epoch, world size, strategy, model, global batch, config). A directory is complete only
once renamed from ``.tmp``; ``latest`` is the newest complete one, chosen by rank 0 and broadcast (ranks on
a network file system with attribute caching can disagree), so a crash mid-save never leaves a
half-written checkpoint that resume would pick.
"""

from __future__ import annotations

import errno
import fnmatch
import json
import os
import random
import shutil
import threading
import time
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import save_file

from .. import comm
from ..errors import BadInput
from ..files import fsync_file, publish_dir, readable_mode, recover_swap, write_atomic
from ..runfolder import BEST, LATEST, META, PREFIX, complete_checkpoints
from ..trained import latest_checkpoint, weights_metadata
from .integrity import (
    CheckpointDamaged,
    check_room,
    gather_listing,
    listing,
    newest_intact,
    raise_storage,
    storage_phrase,
    verify_checkpoint,
)


class CheckpointIncompatible(BadInput, ValueError):
    """A checkpoint another run wrote, or a resume that would mix two runs in one folder."""


def rng_state() -> dict:
    return {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}


def set_rng_state(state: dict) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])


def choose_checkpoint(root: Path, resume: str, log=print) -> tuple[Path | None, str]:
    """The checkpoint to resume from (``resume_source``) and why, decided on rank 0 and broadcast so that every rank
    loads the same one (and every rank raises the same refusal). Rank 0 also removes ``.tmp`` folders that crashed
    saves left behind. The run's own checkpoints are verified against their listing by every rank together
    (``integrity.newest_intact``): a damaged newest one is set aside for the newest intact one; a checkpoint named
    by ``checkpoint.resume`` must be intact."""
    if comm.rank() == 0 and root.is_dir():
        _recover_interrupted_swaps(root)
        for stale in [*root.glob(f"{PREFIX}*.tmp"), *root.glob(f"{PREFIX}*.old")]:
            shutil.rmtree(stale, ignore_errors=True)
    own = newest_intact(root, log)
    decision = None
    if comm.rank() == 0:
        try:
            path, why = resume_source(root, resume, own)
            decision = (None if path is None else str(path), why, None)
        except CheckpointIncompatible as e:
            decision = (None, "", str(e))
    path, why, error = comm.broadcast_object(decision)
    if error is not None:
        raise CheckpointIncompatible(error)
    if path is not None and Path(path) != own and (Path(path) / META).is_file():  # a checkpoint named by resume
        problems = verify_checkpoint(Path(path))
        if problems:
            raise CheckpointDamaged(f"checkpoint.resume = {path} is damaged: {'; '.join(problems[:2])}; allowed: an "
                                    f"intact checkpoint")
    return (None if path is None else Path(path)), why


def _recover_interrupted_swaps(root: Path) -> None:
    """A crash between the two renames of a same-step save (``step_N`` -> ``.old``, ``.tmp`` -> ``step_N``) leaves no
    ``step_N``: publish the complete new one (fsynced, with meta.json) or else put the old one back."""
    sides = [*root.glob(f"{PREFIX}*.tmp"), *root.glob(f"{PREFIX}*.old"), *root.glob(f"{BEST}.tmp"),
             *root.glob(f"{BEST}.old")]
    for final in {side.with_suffix("") for side in sides}:
        recover_swap(final, META)


RESUMABLE = (
    "data.train_path", "data.val_path", "data.num_workers", "data.eval_batch_size", "data.micro_batch_size",
    "data.open_retries", "data.open_retry_backoff_s", "data.max_bad_samples", "data.ffcv_fields", "model.pretrained",
    "parallel.backend", "parallel.timeout_s", "parallel.activation_checkpointing", "parallel.compile",
    "parallel.reshard_after_forward", "parallel.hsdp_replicas", "parallel.hsdp_per_node", "parallel.meta_init",
    "parallel.zero_*", "distill.teacher_checkpoint", "checkpoint.*", "fault.*", "log.*", "run.output_dir",
    "run.eval_every_epochs", "run.nonfinite_policy", "run.max_skipped_steps", "schedule.max_steps", "paper.*",
)
"""Recipe fields a resumed run may change: where the data and files are, how the work is laid out on the machine
(memory knobs, the layout of the same strategy), how the run is logged, checkpointed and stopped. Every other
field defines the run: a checkpoint written with another value of it is another run's, and resuming from it is
refused naming the fields (a Table 3 ablation pointed at a Table 1 run's folder, say)."""


def _flat(tree: dict, prefix: str = "") -> dict:
    out = {}
    for key, value in tree.items():
        if isinstance(value, dict):
            out.update(_flat(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = tuple(value) if isinstance(value, list) else value
    return out


def recipe_differences(saved: dict, current: dict) -> list[str]:
    """The fields (dotted) outside ``RESUMABLE`` whose values differ between two resolved recipes, as
    ``key = saved -> current``. A field the saved recipe does not know (an older release) is not compared."""
    a, b = _flat(saved), _flat(current)
    return [f"{k} = {a[k]!r} -> {b.get(k)!r}" for k in sorted(a)
            if k in b and a[k] != b[k] and not any(fnmatch.fnmatchcase(k, pat) for pat in RESUMABLE)]


def check_compatible(path: Path, meta: dict, config: dict, world_size: int | None = None) -> None:
    """Refuse a checkpoint written by another run: any field of the resolved recipe outside ``RESUMABLE`` that
    differs is named with both values. Any world size resumes any checkpoint (DCP reshards; ZeRO goes through
    DeepSpeed's universal checkpoint), but ZeRO-Offload state on another world size."""
    saved = meta.get("config")
    if saved is None:  # a checkpoint of an older release: the three fields it recorded
        saved = {"parallel": {"strategy": meta.get("strategy")}, "model": {"name": meta.get("model")},
                 "data": {"global_batch_size": meta.get("global_batch_size")}}
        saved = {s: {k: v for k, v in f.items() if v is not None} for s, f in saved.items()}
    diff = recipe_differences(saved, config)
    if diff:
        more = f" (and {len(diff) - 3} more)" if len(diff) > 3 else ""
        raise CheckpointIncompatible(
            f"checkpoint {path} belongs to another run: its recipe differs in {'; '.join(diff[:3])}{more}; resume "
            f"with the same recipe (only {', '.join(RESUMABLE[:6])}, ... may change: checkpoint.RESUMABLE), or start "
            f"a new run in another run.output_dir")
    parallel = config.get("parallel", {})
    if world_size is not None and str(parallel.get("strategy", "")).startswith("zero") and parallel.get(
            "zero_offload") and meta.get("world_size") != world_size:
        raise CheckpointIncompatible(
            f"checkpoint {path} holds ZeRO-Offload state (optimizer on the host) of {meta.get('world_size')} ranks, "
            f"the run has {world_size}: its conversion to DeepSpeed's universal checkpoint is not supported here; "
            f"resume on {meta.get('world_size')} ranks")


def restarted() -> bool:
    """Whether this start is a restart of the same job: Slurm's requeue or torchrun's elastic restart."""
    return any(int(os.environ.get(k, "0") or 0) > 0 for k in ("SLURM_RESTART_COUNT", "TORCHELASTIC_RESTART_COUNT"))


def resume_source(root: Path, resume: str, own: Path | None = None) -> tuple[Path | None, str]:
    """The checkpoint a start resumes from, and why (for the log). A run continues from its own newest checkpoint
    once it has one, whatever ``checkpoint.resume`` says: an explicit source (a path, or none) is for the first
    start only, so that every requeue of a job continues where it stopped.

    - auto: the run's newest checkpoint, or a fresh start;
    - PATH: that checkpoint at the first start, the run's own newest afterwards; an older checkpoint of the run's
      own folder is refused (a run only goes forward: move its newer checkpoints away to go back);
    - none: a fresh start into an empty folder; into one that holds checkpoints it is refused (nothing is pruned
      or overwritten), except on a restart of the job, which continues them.

    ``own``: the run's newest intact checkpoint (``integrity.newest_intact``); by default its newest complete one."""
    own = latest_checkpoint(root) if own is None else own
    if resume == "auto":
        return own, "its newest checkpoint"
    if resume == "none":
        if own is None:
            return None, "a fresh start"
        if restarted():
            return own, "its newest checkpoint (a restart of the job: checkpoint.resume=none was for its first start)"
        raise CheckpointIncompatible(
            f"run.output_dir {root.parent} holds checkpoints up to {own.name}: checkpoint.resume=none would start "
            f"another run into them; resume it (checkpoint.resume=auto), or start in another run.output_dir, or move "
            f"{root} away first")
    path = Path(resume)
    if own is None:
        return path, f"checkpoint.resume = {path}"
    if path.resolve().parent == root.resolve() and _step_of(path) < _step_of(own):
        raise CheckpointIncompatible(
            f"checkpoint.resume = {path} is older than the run's newest checkpoint {own.name}: a run continues from "
            f"its newest; to go back, move the newer checkpoints out of {root} first")
    return own, f"its newest checkpoint (checkpoint.resume = {path} was its starting point)"


def _step_of(path: Path) -> int:
    name = path.name
    return int(name[len(PREFIX):]) if name.startswith(PREFIX) and name[len(PREFIX):].isdigit() else -1


def save_checkpoint(root: Path, strategy, meta: dict, keep_last: int, background: bool = False) -> Path:
    """Every rank calls this; rank 0 publishes and prunes. A save that would not fit, or that the file system
    refuses (no space, a quota, a read-only or forbidden folder), raises :class:`StorageError` on every rank, with
    nothing published: the earlier checkpoints stay as they were.

    With ``background`` (every strategy), the step pays for the copy of the state into host memory; the files are
    written, listed (sizes and checksums) and published by a thread of each rank once every rank's write completed,
    its collectives through the strategy's gloo save group: a crash or a kill before then leaves ``latest`` on the
    previous checkpoint. Its failure is found by the first step after its thread ended (:func:`save_failed`, in the
    step's packed reduction), or else by the next save, the stop save or the end (:func:`wait_for_save`)."""
    wait_for_save()  # at most one save in flight: the previous one is published, or its error raised, first
    rank = comm.rank()
    final = root / f"{PREFIX}{meta['step']:09d}"
    tmp = root / (final.name + ".tmp")
    need = check_room(root, strategy, meta["step"])
    error = None
    if rank == 0:
        try:
            root.mkdir(parents=True, exist_ok=True)
            if tmp.exists():  # left by a crash during an earlier save
                shutil.rmtree(tmp)
            tmp.mkdir()
        except OSError as e:
            error = storage_phrase(e)
    raise_storage(comm.broadcast_object(error), root, tmp, need, meta["step"])
    future, failure = None, None
    try:
        torch.save(rng_state(), tmp / f"rng_rank{rank}.pt")
        fsync_file(tmp / f"rng_rank{rank}.pt")  # by its writer: rank 0's flush of the tree reaches its own node's
        future = strategy.save_async(tmp) if background else strategy.save(tmp)
    except BaseException as e:  # DCP's CheckpointException is a BaseException
        failure = e
    agree_on_failure(failure, f"the save of step {meta['step']}", root, tmp, need, meta["step"])
    if background:
        flight = _InFlight(target=_write_then_publish, name=f"checkpoint-{final.name}",
                           args=(future, strategy.save_group, root, tmp, final, meta, keep_last, need))
        _IN_FLIGHT.append(flight)
        flight.start()
        return final
    _list_and_publish(root, tmp, final, meta, keep_last, need)
    return final


def _list_and_publish(root: Path, tmp: Path, final: Path, meta: dict, keep_last: int, need: int, group=None) -> None:
    """Every rank of ``group`` (the process group if None), once every rank's files are in ``tmp``: the listing,
    each rank reading its share, then rank 0's publication; a storage failure raises on every rank."""
    files, failure = None, None
    try:
        files = listing(tmp, comm.rank(), comm.world_size())  # this rank's share
    except Exception as e:  # told to the others: they would wait in the gather until its timeout
        failure = e
    agree_on_failure(failure, f"the listing of the checkpoint of step {meta['step']}", root, tmp, need, meta["step"],
                     group)
    files, failure = gather_listing(files, group), None
    if comm.rank() == 0:
        try:
            publish_checkpoint(root, tmp, final, meta, files, keep_last)
        except Exception as e:  # told to the others: they would wait for rank 0 until the group's timeout
            failure = e
    agree_on_failure(failure, f"the publication of the checkpoint of step {meta['step']}", root, tmp, need,
                     meta["step"], group)


def publish_checkpoint(root: Path, tmp: Path, final: Path, meta: dict, files: dict | None, keep_last: int) -> None:
    """Rank 0, once every rank's files are in ``tmp``: meta.json (with the listing of the files, sizes and checksums:
    ``listing`` computes it where no listing was gathered), the atomic publication, ``latest``, pruning."""
    files = listing(tmp) if files is None else files
    hook = os.environ.get(_PUBLISH_HOOK_ENV, "")  # tests: "STEP:SECONDS", a kill lands between write and publication;
    if hook and int(hook.split(":")[0]) == meta["step"]:  # "STEP:EIO", the file system fails the publication
        what = hook.split(":")[1]
        if what == "EIO":
            raise OSError(errno.EIO, "Input/output error (CONVIT_SCALE_TEST_PUBLISH)", str(tmp / META))
        time.sleep(float(what))
    (tmp / META).write_text(json.dumps({**meta, "files": files}, indent=1))
    publish_dir(tmp, final)
    write_atomic(root / LATEST, final.name + "\n")
    for stale in complete_checkpoints(root)[:-keep_last]:
        shutil.rmtree(stale, ignore_errors=True)


_PUBLISH_HOOK_ENV = "CONVIT_SCALE_TEST_PUBLISH"


class _InFlight(threading.Thread):
    """The thread that waits for a save's write and publishes it; ``error`` is what ended it, if anything."""

    error: BaseException | None = None

    def run(self):
        try:
            super().run()
        except BaseException as e:  # re-raised on the training thread by wait_for_save
            self.error = e


_IN_FLIGHT: list[_InFlight] = []
"""The save being written (one at most)."""


def _write_then_publish(future, group, root: Path, tmp: Path, final: Path, meta: dict, keep_last: int,
                        need: int) -> None:
    """The background thread of every rank: wait for this rank's write, agree with the others (through ``group``)
    that every write completed, then list and publish as a save at once does. A write that failed on any rank
    publishes nothing on any: a storage failure is the same :class:`StorageError` everywhere. A failure leaves no
    folder behind (rank 0 removes the unpublished one: a whole checkpoint's disk)."""
    try:
        _agree_then_publish(future, group, root, tmp, final, meta, keep_last, need)
    except BaseException:
        if comm.rank() == 0:
            shutil.rmtree(tmp, ignore_errors=True)
        raise


def _agree_then_publish(future, group, root: Path, tmp: Path, final: Path, meta: dict, keep_last: int,
                        need: int) -> None:
    failure = None
    try:
        if future is not None:
            future.result()
    except BaseException as e:
        failure = e
    agree_on_failure(failure, f"the background save of step {meta['step']}", root, tmp, need, meta["step"], group)
    _list_and_publish(root, tmp, final, meta, keep_last, need, group)


def agree_on_failure(failure: BaseException | None, what: str, root: Path, tmp: Path, need: int, step: int,
                     group=None) -> None:
    """Every rank of ``group`` (the process group if None) with its own ``failure`` (None if it had none): a
    storage failure of any rank raises :class:`StorageError` on every rank, any other failure of any rank raises
    on every rank too (its own error on the rank that had it, a RuntimeError naming that rank elsewhere), so no
    rank goes on to a collective the others never reach. A failure that is no ``Exception`` (DCP's
    CheckpointException) is raised as a RuntimeError from it, so that callers can tell it from an interrupt."""
    storage = None if failure is None else storage_phrase(failure)
    other = None if failure is None or storage else f"rank {comm.rank()}: {type(failure).__name__}: {failure}"[:300]
    outcomes = comm.all_gather_object((storage, other), group)
    raise_storage(next((s for s, _ in outcomes if s), None), root, tmp, need, step)
    if failure is not None and isinstance(failure, (Exception, KeyboardInterrupt, SystemExit)):
        raise failure
    if failure is not None or any(o for _, o in outcomes):
        raise RuntimeError(f"{what} failed on {next(o for _, o in outcomes if o)}; `latest` stays on the previous "
                           f"checkpoint") from failure


def save_in_flight() -> bool:
    return any(t.is_alive() for t in _IN_FLIGHT)


def save_failed() -> bool:
    """Whether this rank's save in flight has ended with an error that ``wait_for_save`` has not raised yet. Under
    the test hook's failure (``CONVIT_SCALE_TEST_PUBLISH=STEP:EIO``) the save in flight is waited for first: the
    tests know the step at which it is found (the step after it), which a thread's end would otherwise race."""
    if os.environ.get(_PUBLISH_HOOK_ENV, "").endswith(":EIO"):
        for flight in _IN_FLIGHT:
            flight.join()
    return any(not t.is_alive() and t.error is not None for t in _IN_FLIGHT)


def wait_for_save() -> None:
    """Wait until the save in flight, if any, is written and published (every rank calls this: the next save, a
    stop, the end, or the way out of a failed run); its error, if it failed, raises here."""
    while _IN_FLIGHT:
        flight = _IN_FLIGHT[-1]
        flight.join()  # listed until it has ended: an interrupt here leaves it to the next wait
        _IN_FLIGHT.pop()
        if flight.error is not None:
            raise flight.error


def save_best(root: Path, state: dict | None, meta: dict) -> Path:
    """Every rank calls this; rank 0, which holds the gathered ``state`` (the strategy's ``full_state_dict``),
    writes ``root/best`` in place of the previous best."""
    final = root / BEST
    if comm.rank() == 0:
        tmp = root / (BEST + ".tmp")
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
        save_file({k: v.contiguous() for k, v in state.items()}, str(tmp / "model.safetensors"),
                  metadata=weights_metadata(meta))
        readable_mode(tmp / "model.safetensors")
        (tmp / META).write_text(json.dumps({**meta, "files": listing(tmp)}, indent=1))
        publish_dir(tmp, final)
    comm.barrier()
    return final


def load_checkpoint(path: Path, strategy) -> dict:
    meta = json.loads((path / META).read_text())
    strategy.load(path, meta.get("world_size"))
    rng_file = path / f"rng_rank{comm.rank()}.pt"
    if rng_file.is_file() and meta.get("world_size") == comm.world_size():
        set_rng_state(torch.load(rng_file, weights_only=False))  # our own file: numpy's state is a tuple
    return meta


def read_meta(path: Path) -> dict:
    """A checkpoint's ``meta.json`` (FileNotFoundError naming the folder when it is not a complete checkpoint)."""
    if not (path / META).is_file():
        raise FileNotFoundError(f"checkpoint.resume: {path} is not a complete checkpoint (no meta.json)")
    return json.loads((path / META).read_text())
