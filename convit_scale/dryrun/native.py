"""The driverless CUDA (``driverless_cuda.cpp``) built once per torch release and Python environment with torch's own
extension builder and kept in a per-user cache (``~/.cache/convit-scale/driverless-cuda/<torch version>-<environment
tag>``, or ``$XDG_CACHE_HOME``; ``extensions.py``): the first dry run of an environment compiles it, later ones load
it."""

from __future__ import annotations

import importlib
import os
import platform
import shutil
from pathlib import Path

import torch
from torch.utils.cpp_extension import load as load_extension

from ..extensions import cache_root, environment_tag

SOURCE = Path(__file__).with_name("driverless_cuda.cpp")


def cache_dir() -> Path:
    tag = torch.__version__.replace("+", "_")
    return cache_root() / "convit-scale" / "driverless-cuda" / f"{tag}-{environment_tag()}"  # per env: extensions.py


def build_problem() -> str | None:
    """Why the extension cannot be built here, or None."""
    if platform.system() != "Linux":
        return f"the driverless CUDA is built for Linux only (this is {platform.system()})"
    if shutil.which(os.environ.get("CXX", "c++")) is None and shutil.which("g++") is None:
        return "no C++ compiler (c++ or g++) to build the driverless CUDA extension"
    return None


def load():
    """The extension module (built on first use)."""
    folder = cache_dir()
    folder.mkdir(parents=True, exist_ok=True)
    torch_lib = Path(torch.__file__).parent / "lib"
    return load_extension("convit_scale_driverless_cuda", [str(SOURCE)], build_directory=str(folder),
                          extra_ldflags=[f"-L{torch_lib}", "-ltorch_cpu", "-lc10"], verbose=False)


NEEDS = (("torch._subclasses.fake_tensor", "FakeTensorMode"),
         ("torch.testing._internal.distributed.fake_pg", "FakeStore"),
         ("torch.distributed._tools.mem_tracker", "MemTracker"), ("torch._C", "_set_only_lift_cpu_tensors"),
         ("torch.distributed.fsdp", "fully_shard"))
"""What the simulated GPUs use of torch (all in torch 2.6 and later)."""


def simulation_problem() -> str | None:
    """Why the installed torch (or this machine) cannot simulate GPUs, in one line; None where it can."""
    for module, name in NEEDS:
        try:
            getattr(importlib.import_module(module), name)
        except (ImportError, AttributeError):
            return (f"torch {torch.__version__} has no {module}.{name}, which the simulated GPUs use "
                    f"(torch >= 2.6 has it)")
    if torch.version.cuda is None:
        return (f"torch {torch.__version__} is a CPU-only build: its CUDA hooks, which the simulated GPUs answer, are "
                f"not there (install a CUDA build of torch; it runs on a machine without a GPU)")
    if torch.cuda.is_available():
        return ("a GPU is visible: the dry run replaces CUDA's device guard for the whole process, so it runs only "
                "where none is (run it with CUDA_VISIBLE_DEVICES= )")
    return build_problem()
