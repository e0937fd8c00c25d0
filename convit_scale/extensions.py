"""Where the C++ extensions compiled on first use are cached: one folder per Python environment and torch release.

A build file of ``torch.utils.cpp_extension`` names the include paths of the environment that wrote it (its torch,
its DeepSpeed, its Python). Two environments that share a home (two checkouts, a cluster's virtual environments)
and one cache folder rebuild each other's extension whenever the other ran last: about a minute of C++ at the start
of a job, with every rank of the node waiting on the build's lock. Keyed by the environment (``sys.prefix``), each
keeps its own build (DeepSpeed's, per kind of CPU too: it compiles for the CPU it builds on).
"""

from __future__ import annotations

import functools
import hashlib
import os
import platform
import subprocess
import sys
from pathlib import Path

import torch


def cache_root() -> Path:
    """The per-user cache folder: ``$XDG_CACHE_HOME``, else ``~/.cache`` (torch's and numba's too)."""
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")


def environment_tag() -> str:
    """A short name of this Python environment: a digest of its resolved ``sys.prefix``."""
    return hashlib.sha1(os.path.realpath(sys.prefix).encode()).hexdigest()[:10]


def native_target(compiler: str | None = None) -> str:
    """What ``-march=native`` means to the C++ compiler that builds the extensions (``$CXX``, else ``c++``, as torch's
    ``cpp_extension`` chooses it): its resolved ``-march``/``-mtune`` and the instruction sets it enables, one per
    line, sorted; "" where the compiler does not say (none installed, or one without GCC's ``-Q --help=target``)."""
    return _native_target(compiler or os.environ.get("CXX") or "c++")


@functools.lru_cache(maxsize=None)
def _native_target(compiler: str) -> str:
    try:
        res = subprocess.run([compiler, "-march=native", "-Q", "--help=target"], capture_output=True, text=True,
                             timeout=60)
    except (OSError, subprocess.TimeoutExpired):
        return ""
    if res.returncode != 0:
        return ""
    kept = set()
    for line in res.stdout.splitlines():
        words = line.split()
        if len(words) == 2 and (words[0] in ("-march=", "-mtune=") or words[1] == "[enabled]"):
            kept.add(words[0] + words[1])
    return "\n".join(sorted(kept))


def cpu_tag(cpuinfo: str = "/proc/cpuinfo", compiler: str | None = None) -> str:
    """A short name of the kind of CPU that DeepSpeed's builds are for. DeepSpeed compiles its CPU ops with
    ``-march=native``: a build from a login node's newer CPU stops a compute node's older one with an illegal
    instruction. The name is a digest of what ``-march=native`` means to the compiler (``native_target``: exactly
    what the build's code may use), else of the CPU's flags (``cpuinfo``, Linux: they also hold flags of the kernel
    and the microcode, so an update there costs one needless rebuild), else the machine's type."""
    target = native_target(compiler)
    if target:
        return hashlib.sha1(target.encode()).hexdigest()[:6]
    try:
        with open(cpuinfo) as f:
            flags = next((line for line in f if line.startswith(("flags", "Features"))), "")
    except OSError:
        flags = ""
    return hashlib.sha1(" ".join(sorted(flags.split(":", 1)[-1].split())).encode()).hexdigest()[:6] if flags \
        else platform.machine()


def use_own_torch_extensions_dir() -> str:
    """``TORCH_EXTENSIONS_DIR``, where DeepSpeed's JIT-built ops (its CPU Adam) go: unless set, torch's default
    folder of this Python and accelerator (``~/.cache/torch_extensions/py311_cpu``) with the torch release, this
    environment's tag and the CPU's (``cpu_tag``), set for this process and its children."""
    if not os.environ.get("TORCH_EXTENSIONS_DIR"):
        accelerator = f"cu{torch.version.cuda.replace('.', '')}" if torch.version.cuda else "cpu"
        release = torch.__version__.replace("+", "_")
        folder = (f"py{sys.version_info.major}{sys.version_info.minor}_{accelerator}-torch{release}-"
                  f"{environment_tag()}-cpu{cpu_tag()}")
        os.environ["TORCH_EXTENSIONS_DIR"] = str(cache_root().resolve() / "torch_extensions" / folder)
    return os.environ["TORCH_EXTENSIONS_DIR"]
