"""What the simulated GPUs see: the dispatch mode that sends device work to torch's fake tensors and runs host work
for real, and the census it keeps of what a GPU run would wait for or refuse.

Routing (``Route``): an op goes to the fake mode when it touches a fake tensor or names a cuda device; its real inputs
are made fake first, so that a host tensor the op copies to the device is a copy the fake mode sees (and not a value
it folds in as a constant). Every other op runs for real on the CPU: the project draws its plans on the host
(``bool()`` and ``.tolist()`` of CPU tensors, the device mesh's ranks), which one global fake mode would refuse.

The census, each event with the project frame (file:line under convit_scale/) that made it:
- host waits: a host read of a device value (``.item()``, ``bool()``, ``.tolist()``, a blocking device-to-host copy)
  and ``torch.cuda.synchronize`` and the stream/event waits (counted by ``device.py``);
- pageable copies: a host-to-device copy from memory that is not page-locked (``pin_memory`` is tracked here);
- collectives handed a CPU tensor (NCCL refuses them; the real ``cpu:gloo,cuda:nccl`` group sends them through gloo);
- a device mismatch (an op mixing a cuda tensor with a CPU one) ends the run as ``DeviceMismatch``.
"""

from __future__ import annotations

import sys
import traceback
import weakref
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten, tree_map

PACKAGE = Path(__file__).resolve().parents[1]
HERE = Path(__file__).resolve().parent
aten = torch.ops.aten
LIBRARY_PLUMBING = ("/torch/", "/deepspeed/accelerator/", "/deepspeed/comm/")
"""Library frames that only pass a call on: the origin of an event is the first frame outside them."""
NO_DATA = (torch.ops.c10d.barrier.default,)
"""Collectives that move no data of the caller's (a barrier's token is the backend's)."""
SMALL = 1 << 16
"""Integer host tensors up to this many elements copied to the device keep their values for a read back
(``Route._value``)."""
OBJECT_COLLECTIVES = ("all_gather_object", "broadcast_object_list", "gather_object", "scatter_object_list")
"""torch.distributed's object collectives: pickles on the host, by design (CPU bookkeeping, not the hot path)."""


ELEMENT_ACCESS = (aten.select.int, aten.alias.default, aten._local_scalar_dense.default, aten.view.default,
                  aten.detach.default, aten.lift_fresh.default)
"""The ops of reading a tensor's elements one by one (``.tolist()`` of a fake tensor)."""


class DeviceMismatch(RuntimeError):
    """An op mixed tensors of the device and the host: a GPU run stops there."""


@dataclass(frozen=True)
class Event:
    kind: str
    """"host wait", "pageable copy" or "cpu collective"."""
    what: str
    """The op or call: "aten._local_scalar_dense", "torch.cuda.synchronize", "c10d.allreduce_"."""
    frame: str
    """The project frame that made it (convit_scale/...:line), or "-" outside the project."""
    origin: str
    """The innermost frame outside torch: the project's, or a library's (deepspeed/...: function)."""
    phase: str
    """"setup", "step N" (from 1) or "eval"."""


@dataclass
class Census:
    events: list[Event] = field(default_factory=list)
    phase: str = "setup"
    _last_read: tuple | None = None
    """Where the last host read was made (frame, instruction), while no other work came after it: ``.tolist()`` of a
    fake tensor reads it element by element, which is one read."""

    def add(self, kind: str, what: str) -> None:
        frame, origin = frames()
        self.events.append(Event(kind, what, frame, origin, self.phase))

    def read(self, what: str) -> None:
        """A host read of a device value: one per Python call, however many elements it reads."""
        caller = _project_frame()
        key = None if caller is None else (id(caller), caller.f_lasti)
        if key is not None and key == self._last_read:
            return
        self.add("host wait", what)
        self._last_read = key

    def other_work(self) -> None:
        self._last_read = None

    def of(self, kind: str, phase: str | None = None) -> list[Event]:
        return [e for e in self.events if e.kind == kind and (phase is None or e.phase == phase)]

    def per_step(self, kind: str, steps: range) -> Counter:
        """(frame, origin, what) -> occurrences per step over ``steps`` (step numbers from 1)."""
        names = {f"step {s}" for s in steps}
        found = Counter((e.frame, e.origin, e.what) for e in self.events if e.kind == kind and e.phase in names)
        return Counter({k: v / max(len(steps), 1) for k, v in found.items()})


def _relative(path: str) -> str | None:
    p = Path(path)
    for root, prefix in ((PACKAGE, "convit_scale"),):
        if p.is_relative_to(root):
            return f"{prefix}/{p.relative_to(root)}"
    return None


def frames() -> tuple[str, str]:
    """(the innermost project frame outside this package, the innermost frame outside torch and this package)."""
    project, origin = "-", None
    for fs in reversed(traceback.extract_stack(sys._getframe(2))):
        path = Path(fs.filename)
        if path.is_relative_to(HERE):
            continue
        rel = _relative(fs.filename)
        library = "site-packages" in fs.filename and not any(p in fs.filename for p in LIBRARY_PLUMBING)
        if origin is None and (rel is not None or library):
            tail = fs.filename.split("site-packages/")[-1]
            origin = f"{rel}:{fs.lineno}" if rel else f"{tail}: {fs.name}"
        if rel is not None:
            project = f"{rel}:{fs.lineno}"
            break
    return project, origin or project


def _project_frame():
    """The innermost frame of the project outside this package (a live frame), or None."""
    f = sys._getframe(2)
    while f is not None:
        path = Path(f.f_code.co_filename)
        if not path.is_relative_to(HERE) and path.is_relative_to(PACKAGE):
            return f
        f = f.f_back
    return None


def _is_cuda(device) -> bool:
    return device is not None and torch.device(device).type == "cuda"


class Route(TorchDispatchMode):
    """The dispatch mode of the simulated GPUs (see the module's docstring); ``census`` records what it sees."""

    def __init__(self, fake: FakeTensorMode, census: Census):
        super().__init__()
        self.fake, self.census = fake, census
        self.pinned: set[int] = set()  # the storages (data pointers) pin_memory made, alive
        self.values: dict[int, tuple] = {}  # id(fake) -> (host value, version): small tensors copied from the host

    def _goes_to_device(self, flat, kwargs) -> bool:
        return (any(isinstance(a, FakeTensor) or isinstance(a, torch.device) and a.type == "cuda" for a in flat)
                or _is_cuda(kwargs.get("device")))

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is aten.record_stream.default:  # the caching allocator's stream bookkeeping: no memory moves
            return None
        if func is aten.is_pinned.default:
            return self._is_pinned(args[0])
        if func is aten._pin_memory.default:
            return self._pinned(args[0].clone())
        if kwargs.get("pin_memory") and func is not aten._to_copy.default and not _is_cuda(kwargs.get("device")) \
                and not any(isinstance(a, FakeTensor) for a in tree_flatten(args)[0]):  # host memory page-locked at
            return self._pinned(func(*args, **{**kwargs, "pin_memory": False}))  # birth (torch.empty(pin_memory=))
        if func not in ELEMENT_ACCESS:
            self.census.other_work()
        flat, _ = tree_flatten((args, kwargs))
        if func.namespace == "c10d":
            self._collective(func, flat)
        if not self._goes_to_device(flat, kwargs):
            return func(*args, **kwargs)
        return self._on_device(func, flat, args, kwargs)

    def _pinned(self, out: torch.Tensor) -> torch.Tensor:
        ptr = out.untyped_storage().data_ptr()
        self.pinned.add(ptr)
        weakref.finalize(out.untyped_storage(), self.pinned.discard, ptr)
        return out

    def _is_pinned(self, t) -> bool:
        return (isinstance(t, torch.Tensor) and not isinstance(t, FakeTensor)
                and t.untyped_storage().data_ptr() in self.pinned)

    def _collective(self, func, flat) -> None:
        host = [a for a in flat if isinstance(a, torch.Tensor) and not isinstance(a, FakeTensor)]
        if host and func not in NO_DATA and not any(fs.name in OBJECT_COLLECTIVES for fs in traceback.extract_stack()):
            self.census.add("cpu collective", f"c10d.{func._opname}")

    def _on_device(self, func, flat, args, kwargs):
        if func is aten._local_scalar_dense.default:
            self.census.read("a host read of a device value (.item(), bool(), .tolist(), float())")
            return _zero_scalar(args[0].dtype)
        host_copy = self._device_to_host(func, args, kwargs)
        if host_copy is not None:
            return host_copy
        src = self._host_to_device(func, args, kwargs)
        lifted, lifted_kwargs = tree_map(self._lift, (args, kwargs))
        try:
            with self.fake:
                out = func(*lifted, **lifted_kwargs)
        except (RuntimeError, ValueError) as e:
            if "device" in str(e) and ("cpu" in str(e) and "cuda" in str(e)):
                frame, _ = frames()
                raise DeviceMismatch(f"device mismatch in {func} at {frame}: {str(e).splitlines()[0]}") from None
            raise
        if src is not None and src.numel() <= SMALL and not src.is_floating_point():
            self._remember(out if func is aten._to_copy.default else args[0], src)
        elif func is torch.ops.c10d.broadcast_.default:  # rank 0, the source, keeps its values
            for t in tree_flatten(args)[0]:
                if isinstance(t, FakeTensor) and id(t) in self.values:
                    self.values[id(t)] = (self.values[id(t)][0], t._version)
        return out

    def _remember(self, fake: torch.Tensor, value: torch.Tensor) -> None:
        """The host value of a small tensor copied to the device, read back by a device-to-host copy while the
        device tensor is unchanged (DDP's bucket indices, broadcast from rank 0 and read back)."""
        key = id(fake)
        self.values[key] = (value.detach().clone(), fake._version)
        weakref.finalize(fake, self.values.pop, key, None)

    def _value(self, fake: torch.Tensor, dtype) -> torch.Tensor:
        known = self.values.get(id(fake))
        if known is not None and known[1] == fake._version and known[0].shape == fake.shape:
            return known[0].to(dtype or fake.dtype)
        return torch.zeros(fake.shape, dtype=dtype or fake.dtype)

    def _lift(self, a):
        if isinstance(a, torch.Tensor) and not isinstance(a, FakeTensor):
            return self.fake.from_tensor(a)
        return a

    def _device_to_host(self, func, args, kwargs):
        """A copy of a device tensor into host memory: a host wait when blocking; the host copy holds zeros."""
        if func is aten._to_copy.default and isinstance(args[0], FakeTensor) and args[0].device.type == "cuda" \
                and kwargs.get("device") is not None and torch.device(kwargs["device"]).type == "cpu":
            if not (kwargs.get("non_blocking", False) and kwargs.get("pin_memory", False)):  # into pageable memory
                self.census.read("a blocking device-to-host copy (.cpu(), .to('cpu'), .tolist())")
            return self._value(args[0], kwargs.get("dtype"))
        if func is aten.copy_.default and not isinstance(args[0], FakeTensor) and isinstance(args[1], FakeTensor):
            non_blocking = (len(args) > 2 and args[2]) or kwargs.get("non_blocking", False)
            if not (non_blocking and self._is_pinned(args[0])):  # into pageable memory, CUDA waits whatever asked
                self.census.read("a blocking device-to-host copy (copy_)")
            return args[0].copy_(self._value(args[1], None))
        return None

    def _host_to_device(self, func, args, kwargs) -> torch.Tensor | None:
        """The host tensor a host-to-device copy reads (a pageable one is counted), or None."""
        src = None
        if func is aten._to_copy.default and _is_cuda(kwargs.get("device")) and not isinstance(args[0], FakeTensor):
            src = args[0]
        elif func is aten.copy_.default and isinstance(args[0], FakeTensor) and not isinstance(args[1], FakeTensor):
            src = args[1]
        if src is not None and src.device.type == "cpu" and src.dim() > 0 and not self._is_pinned(src):
            self.census.add("pageable copy", f"{func} of {tuple(src.shape)} {src.dtype} from pageable memory")
        return src if src is not None and src.device.type == "cpu" else None


def _zero_scalar(dtype: torch.dtype):
    if dtype == torch.bool:
        return False
    return 0.0 if dtype.is_floating_point or dtype.is_complex else 0
