"""How ffcv is imported (convit_scale/ffcv_threads.py), in a fresh process as every rank imports it: OpenCV's pool
kept to one thread per worker unless the environment says otherwise, torch's thread count kept, ffcv's compiler serial
whatever it is asked, and numba's shared writable uint8 vector type left writable by ffcv's OS cache manager."""

from __future__ import annotations

import os
import subprocess
import sys

FRESH = """
import os, torch
torch.set_num_threads(3)
import convit_scale  # configure() runs on import
print("opencv", os.environ["OPENCV_FOR_THREADS_NUM"])
from convit_scale.ffcv_threads import importing_ffcv
with importing_ffcv():
    from ffcv.loader import Loader
    from ffcv.memory_managers.os_cache import OSCacheManager
    from ffcv.pipeline.compiler import Compiler
import numba, numba.typed
print("torch", torch.get_num_threads())
numba_threads = numba.get_num_threads()
Compiler.set_num_threads(8)  # what every ffcv Loader asks
print("compiler", Compiler.num_threads, torch.get_num_threads(), numba.get_num_threads() == numba_threads)
OSCacheManager.state_type.fget(None)  # ffcv's own typed its state by making numba.uint8[::1] read-only
print("writable", numba.uint8[::1].mutable, numba.typed.Dict.__module__)
"""


def _fresh(**env) -> dict[str, list[str]]:
    full = {k: v for k, v in os.environ.items() if k != "OPENCV_FOR_THREADS_NUM"}
    out = subprocess.run([sys.executable, "-c", FRESH], capture_output=True, text=True, env={**full, **env},
                         timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    return {line.split()[0]: line.split()[1:] for line in out.stdout.splitlines()}


def test_ffcv_imported_through_the_package_keeps_threads_serial_and_numbas_types_writable():
    got = _fresh()
    assert got["opencv"] == ["1"]
    assert got["torch"] == ["3"]  # ffcv's first import would set it to 1
    assert got["compiler"] == ["1", "3", "True"]  # neither torch's nor numba's count changed by a Loader
    assert got["writable"] == ["True", "numba.typed.typeddict"]  # numba's own Dict back after the import
    assert _fresh(OPENCV_FOR_THREADS_NUM="4")["opencv"] == ["4"]  # what the environment gives is kept
