"""Process-group start-up for every launcher: alone, torchrun, Slurm srun, accelerate launch.

- torchrun / accelerate set RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT.
- srun (one task per GPU) sets SLURM_PROCID, SLURM_NTASKS, SLURM_LOCALID; the master is the first host
  of SLURM_JOB_NODELIST and the port is derived from SLURM_JOB_ID (several jobs can share a node).
- alone: a one-process group on a free local port, so every code path is the same.
NCCL on GPUs, gloo on CPU, unless the recipe says otherwise.
"""

from __future__ import annotations

import datetime
import math
import os
import re
import socket
import subprocess
import sys
from dataclasses import dataclass

import torch
import torch.distributed as dist

from .. import comm
from ..config import group_shares
from ..errors import BadInput


@dataclass
class DistContext:
    rank: int
    world_size: int
    local_rank: int
    device: torch.device
    backend: str
    launcher: str
    owns_group: bool = True
    """Whether this run started the process group (and so ends it); a caller that formed it keeps it."""

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def slurm_master_addr() -> str:
    """The job's first node (``scontrol show hostnames``): where rank 0 runs under srun."""
    nodelist = os.environ.get("SLURM_STEP_NODELIST") or os.environ.get("SLURM_JOB_NODELIST", "")
    try:
        hosts = subprocess.run(["scontrol", "show", "hostnames", nodelist], capture_output=True, text=True,
                               check=True).stdout.split()
        return hosts[0]
    except (OSError, subprocess.CalledProcessError, IndexError):
        return "127.0.0.1"


def _env_from_slurm() -> str:
    """Fill torch's env:// variables from Slurm's when srun started us directly."""
    if "RANK" in os.environ or "SLURM_PROCID" not in os.environ or "SLURM_NTASKS" not in os.environ:
        if any(k.startswith("ACCELERATE_") for k in os.environ):
            return "accelerate"
        return "torchrun" if "TORCHELASTIC_RUN_ID" in os.environ else ("env" if "RANK" in os.environ else "alone")
    os.environ["RANK"] = os.environ["SLURM_PROCID"]
    os.environ["WORLD_SIZE"] = os.environ["SLURM_NTASKS"]
    os.environ["LOCAL_RANK"] = os.environ.get("SLURM_LOCALID", "0")
    if "MASTER_ADDR" not in os.environ:  # slurm/launch.sh exports it: no scontrol call per rank then
        os.environ["MASTER_ADDR"] = slurm_master_addr()
    os.environ.setdefault("MASTER_PORT", str(job_port(os.environ.get("SLURM_JOB_ID", "0"))))
    return "srun"


def job_port(job_id: str | int) -> int:
    """The rendezvous port of a Slurm job: 10000-29999 by job id, so that jobs sharing a node differ, and below
    Linux's ephemeral range (from 32768), where any outgoing connection of the node could already hold it."""
    return 10000 + int(job_id) % 20000


def check_launcher_env(strategy: str, precision: str) -> None:
    """Refuse an ``accelerate launch`` config that asks for another engine or precision than the recipe:
    accelerate starts the processes, the recipe's parallel section decides how they train."""
    env = os.environ
    wants = [name for name, var in (("FSDP", "ACCELERATE_USE_FSDP"), ("DeepSpeed", "ACCELERATE_USE_DEEPSPEED"))
             if env.get(var, "").lower() == "true"]
    if wants:
        raise BadInput(
            f"the accelerate config asks for {wants[0]} (distributed_type {wants[0].upper()}), but the recipe's "
            f"parallel.strategy = '{strategy}' decides the engine: launch with distributed_type MULTI_GPU "
            f"(recipes/accelerate/*.yaml) and set parallel.strategy in the recipe")
    mp = env.get("ACCELERATE_MIXED_PRECISION", "no").lower()
    if mp not in ("no", precision):
        raise BadInput(f"the accelerate config asks for mixed_precision '{mp}', the recipe for parallel.precision = "
                       f"'{precision}': set mixed_precision 'no' in the accelerate config (the recipe decides)")


def device_for(local_rank: int) -> torch.device:
    """This rank's GPU: ``LOCAL_RANK`` modulo the visible devices, so a site that exposes one GPU per task
    (CUDA_VISIBLE_DEVICES of length 1) and one that exposes all of a node's GPUs both work."""
    return torch.device("cuda", local_rank % torch.cuda.device_count())


def _listed(value: str | None) -> int:
    """How many devices a list names: "0,1,2" (CUDA_VISIBLE_DEVICES, SLURM_STEP_GPUS, SLURM_JOB_GPUS)."""
    return len([v for v in (value or "").split(",") if v.strip()])


def one_gpu_per_task(env=None) -> str | None:
    """A line when each task sees one GPU of a node that has more (``srun --gpus-per-task=1``, ``--gpu-bind=single``
    or a cgroup per task), else None. Each rank then has its own CUDA_VISIBLE_DEVICES of one device: NCCL cannot open
    CUDA peer access between the ranks' processes, and the node's ranks talk through host memory (SHM) instead of
    NVLink."""
    env = os.environ if env is None else env
    visible = env.get("CUDA_VISIBLE_DEVICES")
    count = env.get("SLURM_GPUS_ON_NODE", "")  # a number
    on_node = int(count) if count.isdigit() else _listed(env.get("SLURM_STEP_GPUS") or env.get("SLURM_JOB_GPUS"))
    per_task = env.get("SLURM_GPUS_PER_TASK")
    if not ((visible is not None and _listed(visible) == 1 and on_node > 1) or (per_task == "1" and on_node > 1)):
        return None
    return (f"each task sees one GPU of the node's {on_node} (CUDA_VISIBLE_DEVICES={visible}"
            f"{', SLURM_GPUS_PER_TASK=1' if per_task == '1' else ''}): NCCL cannot use NVLink peer access between "
            f"this node's ranks and goes through host memory; start the step with srun --gpu-bind=none and without "
            f"--gpus-per-task (ask --gpus-per-node; with slurm/launch.sh: SRUN_ARGS=--gpu-bind=none)")


FLIGHT_RECORDER_VARS = ("TORCH_FR_BUFFER_SIZE", "TORCH_NCCL_TRACE_BUFFER_SIZE")
"""NCCL's flight recorder's size, under its names new and old: torch >= 2.7 reads the first (default 2,000 entries:
on) and warns on every rank, on every group, when it finds the second; older ones read only the second (default 0)."""


def flight_recorder_var(version: str | None = None) -> str:
    """The name this torch reads (``version``: ``torch.__version__`` unless given): exactly one is set, so neither
    an old torch misses it nor a new one prints a deprecation warning per rank."""
    major, minor = (int(x) for x in re.match(r"(\d+)\.(\d+)", version or torch.__version__).groups())
    return FLIGHT_RECORDER_VARS[0] if (major, minor) >= (2, 7) else FLIGHT_RECORDER_VARS[1]


def set_flight_recorder(entries: int) -> None:
    """NCCL's flight recorder for the process groups this process forms from now on (``fault.nccl_trace_entries``;
    0: off). On, each collective records an entry with its Python stack: a cost per collective, not per entry kept.
    The other name is removed (a launcher's environment may carry it) so that this torch never sees both."""
    chosen = flight_recorder_var()
    for name in FLIGHT_RECORDER_VARS:
        os.environ.pop(name, None)
    os.environ[chosen] = str(int(entries))


def init_distributed(backend: str = "auto", timeout_s: int = 600) -> DistContext:
    launcher = _env_from_slurm()
    if "RANK" not in os.environ:
        # Alone: a one-process group through env://, as a launcher would set it. The variables are put back when
        # the group ends (comm.destroy): a later launch from this process (a test's sbatch or subprocess, the next
        # run) must not inherit RANK=0 of 1, which would make every rank of its world a lone rank 0.
        alone = {"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1",
                 "MASTER_PORT": str(free_port())}
        saved = {k: os.environ.get(k) for k in alone}
        os.environ.update(alone)
        comm.on_destroy(lambda: _restore_env(saved))
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if backend == "auto":
        backend = "nccl" if torch.cuda.is_available() else "gloo"
    if backend == "nccl":
        if not torch.cuda.is_available():
            raise RuntimeError("parallel.backend = 'nccl' needs CUDA GPUs; none are visible (use 'gloo' or 'auto')")
        device = device_for(local_rank)
        torch.cuda.set_device(device)
        binding = one_gpu_per_task()
        if binding and local_rank == 0:
            print(f"warning: {binding}", file=sys.stderr, flush=True)
        # Both backends: NCCL for the device tensors of the hot path, gloo for object collectives and any CPU
        # bookkeeping (an NCCL-only group refuses CPU tensors: "No backend type associated with device type cpu").
        pg_backend = "cpu:gloo,cuda:nccl"
    else:
        device, pg_backend = torch.device("cpu"), backend
    owns_group = not dist.is_initialized()
    if owns_group:
        try:
            dist.init_process_group(pg_backend, rank=rank, world_size=world,
                                    timeout=datetime.timedelta(seconds=timeout_s),
                                    device_id=device if device.type == "cuda" else None)
        except BaseException:
            comm.destroy()  # no group: only the variables set above are put back
            raise
    comm.set_device(device)
    return DistContext(rank, world, local_rank, device, backend, launcher, owns_group)


def _restore_env(saved: dict) -> None:
    for key, value in saved.items():
        if value is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = value


def solve_batch(global_batch: int, world_size: int, micro_batch: int | None) -> tuple[int, int]:
    """(micro_batch, grad_accumulation) with micro x accumulation x world = global batch, exactly."""
    if global_batch % world_size:
        raise BadInput(f"data.global_batch_size = {global_batch} cannot be split over {world_size} ranks "
                       f"(not divisible); choose a world size that divides it")
    per_rank = global_batch // world_size
    if micro_batch is None:
        return per_rank, 1
    if per_rank % micro_batch:
        raise BadInput(f"data.micro_batch_size = {micro_batch} does not divide the {per_rank} images per rank "
                       f"(global batch {global_batch} over {world_size} ranks)")
    return micro_batch, per_rank // micro_batch


def check_world(cfg, world_size: int) -> tuple[int, int]:
    """The checks that need the world size, run by the launching process before any rank starts and again by
    every rank at set-up: the strategy, the canonical groups (each rank holds at least one whole group: the run, and
    every checkpoint of it, are then the same at any world size up to the group count), the micro-batch in whole
    groups. Returns (micro_batch, grad_accumulation): with unequal shares, the busiest rank's largest micro-batch and
    the micro-batches every rank runs per step (data/geometry.py)."""
    if cfg.parallel.strategy == "none" and world_size > 1:
        raise BadInput(f"parallel.strategy = 'none' on {world_size} ranks would train independent replicas with no "
                       f"gradient sync: choose ddp, fsdp2 or zero1/2/3, or run one process")
    if cfg.parallel.strategy.startswith("zero") and cfg.parallel.precision == "fp16" and not torch.cuda.is_available() \
            and not torch.ops.mkldnn._is_mkldnn_fp16_supported():
        raise BadInput("parallel.precision = 'fp16' with DeepSpeed needs a GPU or a CPU with fp16 support "
                       "(AVX512-FP16/AMX), which this one lacks: use bf16 or fp32 here")
    batch, groups = cfg.data.global_batch_size, cfg.data.groups
    problem = cfg.data.world_size_problem(world_size)
    if problem is not None:
        raise BadInput(problem)
    g = batch // groups
    if groups % world_size:  # unequal shares: micro-batches of whole groups, as many on every rank
        busiest = max(group_shares(groups, world_size)) * g
        micro = cfg.data.micro_batch_size or busiest
        if micro % g:
            raise BadInput(f"data.micro_batch_size = {micro} is not a whole number of canonical groups of {g} "
                           f"images (global batch {batch} in data.canonical_groups = {groups})")
        accum = math.ceil(busiest / micro)
        return math.ceil(busiest // g / accum) * g, accum
    micro, accum = solve_batch(batch, world_size, cfg.data.micro_batch_size)
    if micro % g:
        raise BadInput(f"data.micro_batch_size = {micro} is not a whole number of canonical groups of "
                       f"{g} images (global batch {batch} in data.canonical_groups = {groups}): "
                       f"choose a multiple of {g} that divides {batch // world_size}")
    return micro, accum
