"""What the ZeRO strategy adds to DeepSpeed's engine: the device it runs on, the patches it needs, the bad-step gate,
and the optimizer state put where torch keeps it after DeepSpeed's universal load.

Each function here reads DeepSpeed's internals of the releases ``pyproject.toml`` admits (0.16 to 0.19) and says
which; ``make deepspeed-floor`` runs the tests that depend on them against the oldest.
"""

from __future__ import annotations

import contextlib
import io
import os
import types
from pathlib import Path

import torch

from ..extensions import use_own_torch_extensions_dir
from ..files import fsync_file
from .base import square_sum


def deepspeed_args(device: torch.device):
    """What ``deepspeed.initialize`` gets as ``args``: the rank's own device index. Without it DeepSpeed's engine
    calls ``set_device(LOCAL_RANK)``, which on a site that gives each task one GPU (CUDA_VISIBLE_DEVICES of
    length 1) is "invalid device ordinal" for every local rank but 0."""
    return types.SimpleNamespace(device_rank=device.index if device.index is not None else 0) \
        if device.type == "cuda" else None


def local_rank_of(device: torch.device) -> str:
    """The ``LOCAL_RANK`` DeepSpeed must see for ``device``: its CUDA index (0 for the CPU, which has one)."""
    return str(device.index or 0) if device.type == "cuda" else "0"


@contextlib.contextmanager
def local_rank_as(device: torch.device):
    """``LOCAL_RANK`` set to ``device``'s index for as long as DeepSpeed runs: ZeRO-3 reads it itself, whatever
    device the engine was given, in ``zero.Init`` (``torch.device(device_name(LOCAL_RANK))`` and ``set_device``,
    partition_parameters.py) and in the trace checks of its first steps (zero/utils.py). On a site that gives each
    task one GPU (``--gpus-per-task=1``, ``--gpu-bind=single:1``) the launcher's LOCAL_RANK of local rank 3 names
    cuda:3 while the task sees only cuda:0: "invalid device ordinal". The previous value comes back on leaving."""
    before = os.environ.get("LOCAL_RANK")
    os.environ["LOCAL_RANK"] = local_rank_of(device)
    try:
        yield
    finally:
        if before is None:
            os.environ.pop("LOCAL_RANK", None)
        else:
            os.environ["LOCAL_RANK"] = before


def knows_bf16_overflow_switch() -> bool:
    """Whether the installed DeepSpeed has ``bf16.check_grad_overflow`` (``DeepSpeedBF16Config``, 0.19): its ZeRO-1/2
    then check bf16 gradients for overflow unless told not to, one more all-reduce and host read per step. Releases
    without the key (0.16: ZeRO-1/2 check fp16 only) get no such key, which they would not know."""
    try:
        from deepspeed.runtime.precision_config import DeepSpeedBF16Config
    except ImportError:
        return False
    return "check_grad_overflow" in getattr(DeepSpeedBF16Config, "model_fields", {})


def share_fp32_master_partitions() -> None:
    """Let ZeRO-3 use its fp32 parameter partitions as the master weights instead of a copy of them.

    DeepSpeed means to: when the partitioned parameters already have the master dtype on the optimizer's
    device (fp32 training), ``_create_fp32_partitions`` reuses them. Its test compares a ``torch.device``
    with a device string, which is never equal, so it clones them: 4 more bytes per parameter, 1.25x of the
    16-byte ideal before any buffer. This wraps that method and puts the partitions back where the copy
    is an exact duplicate (same dtype, device and size; not offloaded, swapped or Muon-driven). Mixed
    precision (bf16/fp16 partitions, fp32 master) is untouched. Idempotent.
    """
    from deepspeed.runtime.zero.stage3 import DeepSpeedZeroOptimizer_Stage3 as Stage3

    original = Stage3._create_fp32_partitions
    if getattr(original, "_shares_partitions", False):
        return

    def create_fp32_partitions(self):
        original(self)
        if self.offload_optimizer or getattr(self, "use_muon", False) or getattr(self, "swap_optimizer", False):
            return
        for i, (lp, fp32) in enumerate(zip(self.fp16_partitioned_groups_flat, self.fp32_partitioned_groups_flat)):
            if (lp.dtype == fp32.dtype and lp.device == fp32.device and lp.numel() == fp32.numel() > 0
                    and lp.data_ptr() != fp32.data_ptr() and fp32 not in self.optimizer.state):
                lp.ds_id = fp32.ds_id
                lp.requires_grad = True
                self.fp32_partitioned_groups_flat[i] = lp

    create_fp32_partitions._shares_partitions = True
    Stage3._create_fp32_partitions = create_fp32_partitions


def cpu_adam_like(optimizer: torch.optim.Optimizer):
    """The same AdamW (parameter groups, betas, eps, weight decay) as DeepSpeed's vectorised CPU Adam,
    which ZeRO-Offload steps on the host: DeepSpeed refuses a torch optimizer there. The extension is
    compiled on first use (about a minute, cached per environment: ``extensions.py``)."""
    use_own_torch_extensions_dir()
    from deepspeed.ops.adam import DeepSpeedCPUAdam

    d = optimizer.defaults
    groups = [{"params": g["params"], "weight_decay": g["weight_decay"]} for g in optimizer.param_groups]
    return DeepSpeedCPUAdam(groups, lr=d["lr"], betas=d["betas"], eps=d["eps"], weight_decay=d["weight_decay"],
                            adamw_mode=True)


def build_cpu_adam() -> None:
    """DeepSpeed's CPU Adam compiled (or found up to date) where ``cpu_adam_like`` loads it: ``make cpu-adam``."""
    use_own_torch_extensions_dir()
    from deepspeed.ops.op_builder import CPUAdamBuilder

    CPUAdamBuilder().load()


def skip_shm_comm_build() -> None:
    """DeepSpeed's CPU backend compiles a shared-memory all-reduce (deepspeed_shm_comm) at its first init on each
    machine: about a minute of C++ on 2 cores, for an op that only its tensor-parallel inference calls
    (``inference_all_reduce``). Training's collectives go through torch.distributed, and with the op marked
    unavailable ``inference_all_reduce`` does too."""
    import deepspeed.ops

    deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False


class OptimizerGate:
    """The update of a step goes through the torch optimizer's ``step`` that DeepSpeed's ZeRO optimizer calls: while
    the gate is closed that call does nothing, so weights and moments stay exactly as they were whatever DeepSpeed's
    release does with a non-finite gradient (its overflow checks differ by release, stage and dtype), and the
    engine's ``step`` still resets its own accumulation state."""

    def __init__(self, optimizers):
        self.open = True
        for opt in optimizers:
            step = opt.step
            opt.step = lambda *a, _step=step, **k: _step(*a, **k) if self.open else None

    @contextlib.contextmanager
    def closed(self):
        self.open = False
        try:
            yield
        finally:
            self.open = True


def held_gradients(zero_optimizer) -> list[torch.Tensor]:
    """The reduced gradients DeepSpeed's ZeRO optimizer holds for this rank once the last backward of a step is done:
    its partition, padding included (zeros). ZeRO-1/2 and ZeRO-3 keep them in ``averaged_gradients`` (a list per
    parameter group or sub-group, 0.16 to 0.19); with the optimizer offloaded, in the ``.grad`` of the fp32 partitions
    on the host, which the device fills with asynchronous copies (waited for here)."""
    if getattr(zero_optimizer, "cpu_offload", False):  # ZeRO-1/2 offload
        flats = zero_optimizer.single_partition_of_fp32_groups
    elif getattr(zero_optimizer, "offload_optimizer", False):  # ZeRO-3 offload
        flats = zero_optimizer.fp32_partitioned_groups_flat
    else:
        return [g for grads in zero_optimizer.averaged_gradients.values() if grads is not None
                for g in grads if g is not None]
    if torch.cuda.is_available():
        torch.cuda.synchronize()  # the device-to-host gradient copies (offload steps on the host anyway)
    return [f.grad for f in flats if f.grad is not None]


def partition_square_sum(zero_optimizer, device: torch.device) -> torch.Tensor:
    """This rank's share of the step's squared gradient norm from the gradients DeepSpeed reduced into its partition:
    one multi-tensor norm over ``held_gradients`` (float32 accumulation), no host synchronisation. Summed over the
    ranks it is the squared norm of the reduced gradient (the partitions are disjoint), non-finite exactly when some
    reduced gradient value is, which is when some rank's contribution was."""
    grads = held_gradients(zero_optimizer)
    if not grads:
        return torch.zeros((), dtype=torch.float64, device=device)
    return square_sum(grads, device, dtype=torch.float32).to(device, non_blocking=True)


def place_state_like_torch(optimizer: torch.optim.Optimizer) -> None:
    """Put every optimizer state tensor where torch's own ``Optimizer.load_state_dict`` puts it: ``step`` as float32
    on the parameter's device for a fused or capturable optimizer (else as it is, which is the host), every other
    floating tensor in the parameter's dtype on its device. DeepSpeed's universal load bypasses that rule: it hands
    ``step`` back as the host tensor ``ds_to_universal`` saved (it loads with ``map_location="cpu"``), which the
    fused AdamW of a CUDA run reads through a device pointer: an illegal memory access at the first step on nodes
    without HMM, and the same on every resubmission. Tensors already in place are kept (DeepSpeed's fragment views
    of ZeRO-1/2 point into them). Read by the state's keys: ZeRO-3's universal load empties the groups' parameter
    lists (it fills them per sub-group at each step)."""
    groups = {id(p): g for g in optimizer.param_groups for p in g["params"]}
    for param, state in optimizer.state.items():
        group = groups.get(id(param), optimizer.defaults)
        on_device = bool(group.get("fused") or group.get("capturable"))
        for key, value in state.items():
            if not torch.is_tensor(value):
                continue
            if key == "step":
                want = (torch.float32, param.device) if on_device else (value.dtype, value.device)
            elif value.is_floating_point():
                want = (param.dtype, param.device)
            else:
                want = (value.dtype, param.device)
            if (value.dtype, value.device) != want:
                state[key] = value.to(dtype=want[0], device=want[1])


class FsyncedFiles:
    """DeepSpeed's checkpoint engine for a save at once: each file written by the engine's own (``torch.save``), then
    flushed to the disk by the rank that wrote it, before the save returns. On a shared file system (Lustre, GPFS)
    only the writer's fsync flushes its node's pages; rank 0's flush of the tree before the publication reaches its
    own node's, and a node lost after ``latest`` moved would take the others' files with it."""

    def __init__(self, inner):
        self.inner = inner

    def save(self, state_dict, path: str) -> None:
        self.inner.save(state_dict, path)
        fsync_file(Path(path))

    def __getattr__(self, name):
        return getattr(self.inner, name)


class StagedFiles:
    """DeepSpeed's checkpoint engine for one save beside training (``checkpoint.async_save``): standing in for the
    engine's own during ``save_checkpoint``, it serializes each file's state into host memory as that engine would
    (``torch.save``, with its zipfile setting where the release has one: 0.19's is configurable, 0.16's is torch's
    default); ``result()``, which the background publication calls on its own thread, writes and fsyncs the files.
    The step pays for the copy to the host and the serialization, as DCP's async save pays for its staging; the files
    load as a save at once's do (the same state; a zip archive's inner folder is ``archive`` rather than the file's
    name, as for any ``torch.save`` into a buffer). Every other call is the engine's own checkpoint engine's."""

    def __init__(self, inner):
        if type(inner).__name__ != "TorchCheckpointEngine":  # the config convit-scale writes chooses this one
            raise RuntimeError(f"checkpoint.async_save stages the files of DeepSpeed's TorchCheckpointEngine; this "
                               f"engine has {type(inner).__name__}")
        self.inner = inner
        self.files: list[tuple[str, io.BytesIO]] = []

    def save(self, state_dict, path: str) -> None:
        buffer = io.BytesIO()
        zipfile = getattr(self.inner, "zipfile_serialization", True)
        torch.save(state_dict, buffer, _use_new_zipfile_serialization=zipfile)
        self.files.append((str(path), buffer))

    def result(self) -> None:
        while self.files:
            path, buffer = self.files.pop(0)
            with open(path, "wb") as f:
                f.write(buffer.getbuffer())
                f.flush()
                os.fsync(f.fileno())

    def __getattr__(self, name):
        return getattr(self.inner, name)
