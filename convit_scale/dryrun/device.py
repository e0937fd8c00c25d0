"""Simulated GPUs for one process: ``torch.cuda`` and ``torch.accelerator`` answered as a node of ``gpus_per_node``
devices (patched for the duration only, put back after), the driverless CUDA of ``native`` under autograd, the fake
tensor mode behind ``census.Route``, and a fake process group of the job's world size (this process is rank 0).

The process group has a fake backend for the cuda device alone and another for the CPU (``cpu:fakecpu,cuda:fakecuda``)
as the real ``cpu:gloo,cuda:nccl`` group: a collective handed a CPU tensor reaches the CPU one, and the census counts
it. The fake group computes nothing: its all-gathers hold zeros, so the libraries' cross-rank checks are skipped
(DDP's parameter shapes, ZeRO-3's traces), and DDP's gradient buckets are reduced by a comm hook (``ddp_comm_hook``),
because the fake group's work future holds no tensor.
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
import sys
import weakref
from types import SimpleNamespace

import torch
import torch.distributed as dist
import torch.distributed.utils as dist_utils
import torch.nn.parallel.distributed as ddp
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.testing._internal.distributed import fake_pg
from torch.testing._internal.distributed.fake_pg import FakeStore

from .. import comm
from .census import Census, Route
from .native import load

FAKE_BACKENDS = "cpu:fakecpu,cuda:fakecuda"


class _Stream(torch.Stream):
    """A CUDA stream of the simulated device (the driverless guard's default stream, a ``torch.Stream`` that
    ``record_stream`` accepts): work is ordered, and a wait on it is a host wait."""

    census: Census | None = None

    def __new__(cls, device=None, priority=0, **_):
        index = 0 if device is None else (device if isinstance(device, int) else torch.device(device).index or 0)
        return super().__new__(cls, device=torch.device("cuda", index), priority=priority)

    @property
    def cuda_stream(self) -> int:
        return 0

    def wait_stream(self, other) -> None:
        pass

    def wait_event(self, event) -> None:
        pass

    def record_event(self, event=None):
        return event or _Event()

    def query(self) -> bool:
        return True

    def is_capturing(self) -> bool:
        return False

    def synchronize(self) -> None:
        _Stream.census.add("host wait", "torch.cuda.Stream.synchronize")

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


class _Event:
    def __init__(self, enable_timing=False, blocking=False, interprocess=False, **_):
        pass

    def record(self, stream=None) -> None:
        pass

    def wait(self, stream=None) -> None:
        pass

    def query(self) -> bool:
        return True

    def synchronize(self) -> None:
        _Stream.census.add("host wait", "torch.cuda.Event.synchronize")

    def elapsed_time(self, end) -> float:
        return 0.0


def _properties(index=None):
    return SimpleNamespace(name="simulated GPU", total_memory=80 * 2**30, major=9, minor=0, multi_processor_count=132,
                           is_integrated=False, uuid="simulated")


def cuda_answers(gpus: int, census: Census) -> dict:
    """The ``torch.cuda`` functions a training step calls, as a node of ``gpus`` simulated devices answers them."""
    current = [0]
    _Stream.census = census
    rng = {}

    def set_device(device):
        current[0] = device if isinstance(device, int) else (torch.device(device).index or 0)

    def synchronize(device=None):
        census.add("host wait", "torch.cuda.synchronize")

    def get_rng_state(device="cuda"):
        return rng.get(str(device), torch.zeros(16, dtype=torch.uint8)).clone()

    def set_rng_state(state, device="cuda"):
        rng[str(device)] = state.clone()

    def zero(*a, **k):
        return 0

    return {
        "is_available": lambda: True, "device_count": lambda: gpus, "is_initialized": lambda: True,
        "_lazy_init": lambda: None, "set_device": set_device, "current_device": lambda: current[0],
        "synchronize": synchronize, "Stream": _Stream, "Event": _Event,
        "current_stream": lambda device=None: _Stream(device), "default_stream": lambda device=None: _Stream(device),
        "stream": lambda s=None: contextlib.nullcontext(s), "set_stream": lambda s: None,
        "is_current_stream_capturing": lambda: False, "get_device_properties": _properties,
        "get_device_capability": lambda device=None: (9, 0), "get_device_name": lambda device=None: "simulated GPU",
        "is_bf16_supported": lambda *a, **k: True, "empty_cache": lambda: None,
        "memory_allocated": zero, "max_memory_allocated": zero, "memory_reserved": zero, "max_memory_reserved": zero,
        "memory_cached": zero, "max_memory_cached": zero, "memory_stats": lambda *a, **k: {},
        "reset_peak_memory_stats": lambda *a, **k: None, "reset_max_memory_allocated": lambda *a, **k: None,
        "reset_max_memory_cached": lambda *a, **k: None, "mem_get_info": lambda *a, **k: (80 * 2**30, 80 * 2**30),
        "get_rng_state": get_rng_state, "set_rng_state": set_rng_state,
        "get_rng_state_all": lambda: [get_rng_state(f"cuda:{i}") for i in range(gpus)],
        "set_rng_state_all": lambda states: [set_rng_state(s, f"cuda:{i}") for i, s in enumerate(states)],
        "manual_seed": lambda seed: None, "manual_seed_all": lambda seed: None, "seed": lambda: None,
        "seed_all": lambda: None, "initial_seed": lambda: 0,
    }


def accelerator_answers(gpus: int, cuda: dict) -> dict:
    return {"is_available": lambda: True, "current_accelerator": lambda check_available=False: torch.device("cuda"),
            "device_count": lambda: gpus, "current_device_index": cuda["current_device"],
            "current_device_idx": cuda["current_device"], "set_device_index": cuda["set_device"],
            "set_device_idx": cuda["set_device"], "synchronize": cuda["synchronize"],
            "current_stream": cuda["current_stream"], "set_stream": cuda["set_stream"]}


class Patches:
    """Attributes replaced for the duration, put back in reverse order."""

    def __init__(self):
        self._saved: list = []

    def set(self, owner, name: str, value) -> None:
        missing = object()
        self._saved.append((owner, name, getattr(owner, name, missing), missing))
        setattr(owner, name, value)

    def undo(self) -> None:
        while self._saved:
            owner, name, old, missing = self._saved.pop()
            if old is missing:
                delattr(owner, name)
            else:
                setattr(owner, name, old)


def register_backends() -> None:
    """``fakecpu`` (the CPU alone) and ``fakecuda`` (the cuda device alone), once per process."""
    for name, devices in (("fakecpu", ["cpu"]), ("fakecuda", ["cuda"])):
        if not hasattr(dist.Backend, name.upper()):
            dist.Backend.register_backend(name, fake_pg._create_fake_pg, extended_api=True, devices=devices)


@contextlib.contextmanager
def launch_env(rank: int, world: int, gpus_per_node: int):
    """The variables a launcher sets for rank ``rank`` of ``world`` (``gpus_per_node`` per node), then put back."""
    values = {"RANK": str(rank), "WORLD_SIZE": str(world), "LOCAL_RANK": str(rank % gpus_per_node),
              "LOCAL_WORLD_SIZE": str(gpus_per_node), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500"}
    saved = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def move_to_device(params, buffers, device: torch.device) -> None:
    """FSDP2's move of a host module's states to the device (``_fsdp_init._move_states_to_device``), for fake ones:
    FSDP2 sets ``.data``, which on a fake tensor leaves the parameter on the meta device; this swaps each for a
    fresh device tensor of its shape (the simulated devices hold no values), the objects kept (the optimizer and
    DeepSpeed find parameters by identity)."""
    for tensor in [*params, *buffers]:
        if tensor.device == device or tensor.device.type == "meta":
            continue
        moved = torch.empty(tensor.shape, dtype=tensor.dtype, device=device)  # no host input: nothing to lift
        if isinstance(tensor, torch.nn.Parameter):
            moved = torch.nn.Parameter(moved, requires_grad=tensor.requires_grad)
        torch.utils.swap_tensors(tensor, moved)


def swapper(original, fake):
    """``torch.utils.swap_tensors`` for fake tensors: the fake mode keeps weak references to the tensors it made or
    lifted, which swap_tensors refuses; they are dropped first (``Module.to`` swaps, so that a parameter keeps its
    identity: DeepSpeed maps its parameters by object before moving the module)."""

    def swap_tensors(t1, t2):
        for t in (t1, t2):
            _forget(t, fake)
        # finalizers on them (DeepSpeed's debug names of parameters) move out and come back on the same objects
        kept = [(t, f.detach()) for f, info in list(weakref.finalize._registry.items())
                for t in (t1, t2) if info.weakref() is t]
        try:
            return original(t1, t2)
        finally:
            for t, (_, func, args, kwargs) in kept:
                weakref.finalize(t, func, *args, **(kwargs or {}))

    return swap_tensors


def _forget(t: torch.Tensor, fake) -> None:
    converter = fake.fake_tensor_converter
    memo = converter.tensor_memo
    for key in [k for k, v in list(memo.items()) if v is t]:
        del memo[key]
    describer = getattr(converter.meta_converter, "describer", None)
    if describer is not None and t in describer.lookup_tensor:
        del describer.lookup_tensor[t]


def _library_patches(patches: Patches, fake) -> None:
    """The libraries' cross-rank checks that read the fake group's zeros, skipped; DeepSpeed's accelerator CUDA;
    FSDP2's move of a module to the device (``move_to_device``)."""
    import torch.distributed.fsdp._fully_shard._fsdp_init as fsdp_init

    patches.set(fsdp_init, "_move_states_to_device", move_to_device)
    patches.set(torch.utils, "swap_tensors", swapper(torch.utils.swap_tensors, fake))
    patches.set(dist_utils, "_verify_param_shape_across_processes", lambda *a, **k: None)
    patches.set(ddp, "_verify_param_shape_across_processes", lambda *a, **k: None)
    if "deepspeed" in sys.modules or _has_deepspeed():
        import deepspeed.accelerator.real_accelerator as real
        import deepspeed.runtime.zero.utils as zero_utils
        from deepspeed.accelerator.cuda_accelerator import CUDA_Accelerator

        patches.set(real, "ds_accelerator", CUDA_Accelerator())
        patches.set(zero_utils, "assert_ints_same_as_other_ranks", lambda *a, **k: None)
        for mod in list(sys.modules.values()):  # modules that imported the check by name
            if getattr(mod, "__name__", "").startswith("deepspeed.") and \
                    getattr(mod, "assert_ints_same_as_other_ranks", None) is not None:
                patches.set(mod, "assert_ints_same_as_other_ranks", lambda *a, **k: None)


def _has_deepspeed() -> bool:
    return importlib.util.find_spec("deepspeed") is not None


@contextlib.contextmanager
def simulated_gpus(world: int, gpus_per_node: int, census: Census):
    """This process as rank 0 of ``world`` simulated GPUs (``gpus_per_node`` per node) until the block ends."""
    native, device_before = load(), comm.device()
    if "deepspeed" in sys.modules or _has_deepspeed():  # DeepSpeed keeps the accelerator its import finds: imported
        # here, before torch.cuda answers for the simulated GPUs, it keeps the machine's after the dry run
        from deepspeed.accelerator import get_accelerator

        get_accelerator()
    patches, cuda = Patches(), cuda_answers(gpus_per_node, census)
    lift, swap = torch._C._only_lift_cpu_tensors(), torch.__future__.get_swap_module_params_on_conversion()
    try:
        if not native.install(gpus_per_node):
            raise RuntimeError("the CUDA hooks' primary-context check could not be answered")
        for name, value in cuda.items():
            patches.set(torch.cuda, name, value)
        if hasattr(torch, "accelerator"):
            for name, value in accelerator_answers(gpus_per_node, cuda).items():
                patches.set(torch.accelerator, name, value)
        fake = FakeTensorMode(allow_non_fake_inputs=True)
        fake.cache_enabled = False  # its cache keys hold finalizers on host tensors, which swap_tensors refuses
        _library_patches(patches, fake)
        register_backends()
        torch._C._set_only_lift_cpu_tensors(True)
        torch.__future__.set_swap_module_params_on_conversion(True)
        # The backward runs on the calling thread: the engine sizes its per-device threads once per process, at its
        # first backward, and a process that ran one before the driverless CUDA was registered has none for cuda
        with launch_env(0, world, gpus_per_node), Route(fake, census), \
                torch.autograd.set_multithreading_enabled(False):
            dist.init_process_group(FAKE_BACKENDS, store=FakeStore(), rank=0, world_size=world)
            try:
                yield
            finally:
                comm.destroy()  # and DeepSpeed's references to the group
    finally:
        comm.set_device(device_before)  # the communication device init_distributed chose, put back
        torch._C._set_only_lift_cpu_tensors(lift)
        torch.__future__.set_swap_module_params_on_conversion(swap)
        patches.undo()
        native.uninstall()


def ddp_comm_hook(state, bucket):
    """DDP's all-reduce of a gradient bucket (the collective the census sees), with the bucket as the future's
    result: the fake group's own work future holds no tensor."""
    buffer = comm.all_reduce(bucket.buffer())  # on the bucket's device: reduced in place
    future = torch.futures.Future()
    future.set_result(buffer.div_(dist.get_world_size()))
    return future
