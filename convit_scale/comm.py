"""Every collective of the training loop, evaluation and checkpointing passes through here.

On GPUs the process group has two backends (``cpu:gloo,cuda:nccl``), so object collectives and CPU bookkeeping
stay legal, but the hot path keeps its tensors on the training device: :func:`all_reduce` moves a tensor to the
communication device first, so a CPU tensor can never reach NCCL by accident. With a process group every function
calls the real collective, at world size 1 too, so that a one-GPU run sends each kind through NCCL; without one
(analysis, a library caller) they are the identity. No other module of the package calls ``torch.distributed``
collectives (``tests/test_structure.py`` checks it).
"""

from __future__ import annotations

import contextlib
import datetime
import sys

import torch
import torch.distributed as dist

_device = torch.device("cpu")  # set by set_device() when the process group starts


def set_device(device: torch.device) -> None:
    global _device
    _device = device


def device() -> torch.device:
    """Where tensors handed to collectives live: this rank's GPU, or the CPU under gloo."""
    return _device


def is_initialized() -> bool:
    return dist.is_available() and dist.is_initialized()


def rank() -> int:
    return dist.get_rank() if is_initialized() else 0


def world_size() -> int:
    return dist.get_world_size() if is_initialized() else 1


def all_reduce(t: torch.Tensor, op: str = "sum") -> torch.Tensor:
    """Reduce ``t`` over ranks (sum or max) and return it on the communication device; ``t`` is reduced in place
    when it already lives there. No host synchronisation."""
    t = t.to(_device, non_blocking=True)
    if is_initialized():
        dist.all_reduce(t, op={"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX}[op])
    return t


def all_gather_object(obj, group=None) -> list:
    """``obj`` of every rank, in rank order; ``group``: a gloo group of every rank (a background thread's, whose
    collectives must not interleave with the training thread's on the process group), else the process group."""
    if not is_initialized():
        return [obj]
    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj, group=group)
    return out


def broadcast_object(obj, src: int = 0, group=None):
    """Rank ``src``'s ``obj`` on every rank (e.g. the checkpoint that rank 0 chose); ``group``: a group of
    :func:`patient_group`, else the process group."""
    if not is_initialized():
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=src, group=group)
    return box[0]


@contextlib.contextmanager
def patient_group(timeout_s: float):
    """A gloo group of every rank whose collectives wait up to ``timeout_s``, however short the process group's
    timeout (``parallel.timeout_s``): for the ranks that wait while one rank does long work alone (rank 0 converting
    a checkpoint), which the process group's timeout, or NCCL's watchdog, would otherwise end. Every rank enters it
    before the work starts; the wait is a CPU collective (:func:`broadcast_object` with ``group``), not NCCL's.
    Without a process group: None."""
    if not is_initialized():
        yield None
        return
    group = patient_gloo_group(timeout_s)
    try:
        yield group
    finally:
        destroy_group(group)


_patient: list = []
"""The groups whose own timeout :func:`set_timeout` leaves as it is (:func:`patient_gloo_group`)."""


def patient_gloo_group(timeout_s: float):
    """A gloo group of every rank (every rank calls this) whose collectives wait up to ``timeout_s``, which
    :func:`set_timeout` leaves as it is: the process group's timeout shortened after a phase does not reach it
    (the background saves' group, whose collectives wait for the slowest rank's write beside training). None without
    a process group."""
    if not is_initialized():
        return None
    group = dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=timeout_s))
    _patient.append(group)
    return group


def broadcast_tensors(tensors: list[torch.Tensor], src: int = 0) -> None:
    """Rank ``src``'s values of ``tensors`` into every rank's (same shapes), through the communication device."""
    if not is_initialized():
        return
    for t in tensors:
        moved = t.to(_device)
        dist.broadcast(moved, src=src)
        if moved is not t:
            t.copy_(moved)


def set_timeout(seconds: float) -> bool:
    """Make ``seconds`` the timeout of every later collective of every process group of this rank (the default one
    and its subgroups: FSDP2's mesh, DeepSpeed's; not the patient ones, :func:`patient_gloo_group`), as torchtitan
    shortens it after the first step. torch >= 2.10 has ``dist.set_timeout``; 2.6-2.9 the same as
    ``distributed_c10d._set_pg_timeout``; both reach gloo and NCCL. Returns whether it was set (False without a
    process group, or on a torch with neither)."""
    if not is_initialized():
        return False
    c10d = dist.distributed_c10d
    setter = getattr(dist, "set_timeout", None) or getattr(c10d, "_set_pg_timeout", None)
    if setter is None:
        return False
    timeout = datetime.timedelta(seconds=seconds)
    for group in list(getattr(getattr(c10d, "_world", None), "pg_map", {})) or [None]:
        if any(group is g for g in _patient):  # a timeout of its own
            continue
        try:
            setter(timeout, group)
        except (ValueError, RuntimeError, AssertionError):  # a group this rank is not in, a backend without it (MPI)
            continue
    return True


def barrier(group=None) -> None:
    """All ranks of ``group`` (the default group if None) reach this point."""
    if is_initialized():
        dist.barrier(group=group)


_on_destroy: list = []
"""Callbacks :func:`destroy` runs once after ending the group (the launch variables a one-process group set)."""


def on_destroy(fn) -> None:
    """Run ``fn`` when this process's group is ended by :func:`destroy`."""
    _on_destroy.append(fn)


def destroy_group(group) -> None:
    """End one subgroup (a patient group after its work; the background saves' after a failure): its sockets and
    threads released."""
    _patient[:] = [g for g in _patient if g is not group]
    if is_initialized():
        dist.destroy_process_group(group)


def destroy() -> None:
    """End the process group, and DeepSpeed's references to it when DeepSpeed ran in this process (through its own
    teardown), so that a next run in the same process starts clean; then the callbacks of :func:`on_destroy`."""
    try:
        _destroy_group()
    finally:
        while _on_destroy:
            _on_destroy.pop()()


def _destroy_group() -> None:
    if not is_initialized():
        return
    deepspeed_comm = sys.modules.get("deepspeed.comm")
    if deepspeed_comm is not None and deepspeed_comm.is_initialized():
        deepspeed_comm.destroy_process_group()
        groups = sys.modules.get("deepspeed.utils.groups")
        if getattr(groups, "_WORLD_GROUP", None) is not None:  # releases before 0.19 keep their copy of the world
            groups._WORLD_GROUP = None
    else:
        dist.destroy_process_group()
