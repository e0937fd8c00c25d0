"""``python -m convit_scale.gpu_wheels [FOLDER]`` (``make gpu-wheels``): the folder of wheels a GPU box without network
lacks, built on a machine with one, checked to resolve for that box, and sized. ``--missing MODULE:PACKAGE ...``
(``make gpu-test``): the packages whose module does not import, probed in one interpreter.

The GPU box of ``make gpu-test`` (docs/gpu.md) has Python 3.12 with torch (CUDA), timm, accelerate, rich, pyyaml,
numba, opencv, matplotlib and pytest; it lacks DeepSpeed, WebDataset and FFCV (skipped there), and pytest-timeout,
which ``addopts`` requires (``--timeout``). The folder holds, at the versions this machine's environment tests:
- DeepSpeed as a pure-Python wheel built here (``DS_BUILD_OPS=0``: it compiles its few optional ops just in time,
  and ZeRO with a torch optimizer uses none), since PyPI has no Linux wheel of it;
- its dependencies and WebDataset's as cp312 manylinux wheels (pydantic-core and msgpack are compiled);
- pytest-timeout.
The check resolves the whole set for Python 3.12 on manylinux x86_64 from the folder alone, with stand-ins (empty
wheels, made for the check only) for what the box already has. The folder travels with the working tree to the box,
64 MiB at most for both: the sizes are printed.
"""

from __future__ import annotations

import contextlib
import importlib
import os
import subprocess
import sys
import tempfile
import zipfile
from importlib.metadata import version
from pathlib import Path

DOWNLOADED = ("einops", "hjson", "msgpack", "ninja", "py-cpuinfo", "pydantic", "pydantic-core", "annotated-types",
              "typing-extensions", "typing-inspection", "psutil", "tqdm", "packaging", "webdataset", "braceexpand",
              "pytest-timeout")
"""Wheels downloaded as they are (binary: cp312 manylinux where compiled)."""
BUILT = ("deepspeed",)
"""Wheels built here from the source distribution: no Linux wheel on PyPI."""
WANTED = ("deepspeed", "webdataset", "pytest-timeout")
"""What ``make gpu-test`` installs on the box; the rest of the folder is their dependencies."""
BOX_HAS = {"torch": "2.11.0", "numpy": "2.1.0", "pyyaml": "6.0.2", "pytest": "8.3.0"}
"""What the GPU box already has that the wanted packages require, as the check's stand-ins (versions within their
requirements)."""
PYTHON, PLATFORMS = "3.12", ("manylinux2014_x86_64", "manylinux_2_17_x86_64", "manylinux_2_28_x86_64")
BUDGET = 64 * 2**20
"""The working tree and the folder together, in bytes: what travels to the GPU box."""


def pins() -> dict[str, str]:
    """Every wheel of the folder at the version installed here (the versions the CPU suite runs)."""
    return {name: version(name) for name in (*BUILT, *DOWNLOADED)}


def _pip(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "pip", *args], capture_output=True, text=True,
                          env={**os.environ, **(env or {})})


def _target(*args: str) -> list[str]:
    return [*args, "--only-binary=:all:", "--python-version", PYTHON, "--implementation", "cp",
            *(x for p in PLATFORMS for x in ("--platform", p))]


def fetch(folder: Path, pinned: dict[str, str]) -> None:
    """Download the binary wheels and build DeepSpeed's (network)."""
    folder.mkdir(parents=True, exist_ok=True)
    downloaded = [f"{n}=={pinned[n]}" for n in DOWNLOADED]
    res = _pip(*_target("download", "--no-deps", "-d", str(folder)), *downloaded)
    if res.returncode:
        raise RuntimeError(f"pip download failed: {res.stderr[-3000:]}")
    built = [f"{n}=={pinned[n]}" for n in BUILT]
    res = _pip("wheel", "--no-deps", "--no-build-isolation", "-w", str(folder), *built, env={"DS_BUILD_OPS": "0"})
    if res.returncode:
        raise RuntimeError(f"pip wheel {' '.join(built)} failed: {res.stderr[-3000:]}")


def stub_wheel(folder: Path, name: str, ver: str, requires: tuple[str, ...] = ()) -> Path:
    """An empty wheel of ``name`` ``ver`` (py3, any platform) that requires ``requires``: a stand-in for what the box
    has, for the check only."""
    dist = f"{name.replace('-', '_')}-{ver}"
    path = folder / f"{dist}-py3-none-any.whl"
    metadata = f"Metadata-Version: 2.1\nName: {name}\nVersion: {ver}\n" + "".join(f"Requires-Dist: {r}\n"
                                                                                 for r in requires)
    files = {f"{dist}.dist-info/METADATA": metadata,
             f"{dist}.dist-info/WHEEL": "Wheel-Version: 1.0\nGenerator: convit-scale\nRoot-Is-Purelib: true\n"
                                        "Tag: py3-none-any\n"}
    files[f"{dist}.dist-info/RECORD"] = "".join(f"{f},,\n" for f in files) + f"{dist}.dist-info/RECORD,,\n"
    with zipfile.ZipFile(path, "w") as z:
        for arcname, text in files.items():
            z.writestr(arcname, text)
    return path


def check(folder: Path, wanted=WANTED, box: dict[str, str] | None = None) -> list[str]:
    """What pip would install for ``wanted`` on the box (Python 3.12, manylinux x86_64) from ``folder`` alone, the
    box's own packages standing in as empty wheels: the resolved ``name-version`` list, or RuntimeError with pip's
    reason. Offline (``--no-index``)."""
    with tempfile.TemporaryDirectory() as tmp:
        stubs = Path(tmp) / "box"
        stubs.mkdir()
        for name, ver in (BOX_HAS if box is None else box).items():
            stub_wheel(stubs, name, ver)
        res = _pip(*_target("install", "--dry-run", "--no-index", "--find-links", str(folder), "--find-links",
                            str(stubs), "--target", str(Path(tmp) / "site")), *wanted)
    if res.returncode:
        raise RuntimeError(f"the wheels in {folder} do not resolve for Python {PYTHON}: {res.stderr[-3000:]}")
    line = next((x for x in res.stdout.splitlines() if x.startswith("Would install")), "Would install")
    return line.split()[2:]


def tree_bytes(repo: Path) -> int:
    """The bytes of the working tree that travel with it: git's tracked files and the untracked ones it does not
    ignore."""
    names = subprocess.run(["git", "-C", str(repo), "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
                           capture_output=True, check=True).stdout.split(b"\0")
    return sum((repo / n.decode()).stat().st_size for n in names if n and (repo / n.decode()).is_file())


def folder_bytes(folder: Path) -> int:
    return sum(f.stat().st_size for f in folder.iterdir() if f.is_file())


def missing(pairs: list[str]) -> list[str]:
    """The packages of ``module:package`` pairs whose module does not import, all probed in this one interpreter
    (``make gpu-test``: a fresh interpreter per module cost about a minute of the GPU box's time for 24 probes)."""
    absent = []
    for pair in pairs:
        module, _, package = pair.partition(":")
        # what a module prints on import (DeepSpeed's accelerator line) goes to stderr: stdout is the answer
        with contextlib.redirect_stdout(sys.stderr):
            try:
                importlib.import_module(module)
            except Exception:  # any failure to import (a missing compiled dependency too) means: install it
                absent.append(package or module)
    return absent


def main(argv: list[str]) -> int:
    if argv[:1] == ["--missing"]:  # make gpu-test: the packages to install, space-separated, on one line
        print(" ".join(missing(argv[1:])))
        return 0
    repo = Path(__file__).resolve().parents[1]
    folder = Path(argv[0]) if argv else repo / "build" / "gpu-wheels"
    fetch(folder, pins())
    resolved = check(folder)
    wheels, tree = folder_bytes(folder), tree_bytes(repo)  # a folder in the tree that git does not ignore counts twice
    print(f"{folder}: {len(list(folder.glob('*.whl')))} wheels, {wheels / 2**20:.1f} MiB; resolves for Python "
          f"{PYTHON} (manylinux x86_64) from the folder alone: {' '.join(resolved)}")
    print(f"working tree {tree / 2**20:.1f} MiB + wheels {wheels / 2**20:.1f} MiB = {(tree + wheels) / 2**20:.1f} "
          f"MiB (at most {BUDGET / 2**20:.0f} MiB travel to the GPU box)")
    if tree + wheels > BUDGET:
        print(f"error: the working tree and {folder} together exceed {BUDGET / 2**20:.0f} MiB", file=sys.stderr)
        return 1
    print(f"on the GPU box: make gpu-test GPU_PYTHON=python3.12 WHEELS={folder} GROUP=1")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
