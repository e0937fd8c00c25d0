"""How ffcv is imported into the package: its native code's threads (``configure()``), and every change made to
ffcv's own classes, applied in one place when it is first imported (``importing_ffcv()``).

The FFCV loader's ``num_workers`` threads each decode whole batches (``data/ffcv_epoch.py``) and call OpenCV's
resize from each of them. OpenCV would run every resize on a pool of its own with one thread per core: workers x
cores threads per rank, ranks x that per node. ``OPENCV_FOR_THREADS_NUM=1`` (read when OpenCV loads, with ffcv's
library) keeps one per worker. numba compiles the decoders serial (no ``prange``), so its threading layer is not
used.
"""

from __future__ import annotations

import contextlib
import os
import sys


def configure() -> None:
    """Idempotent and cheap (imports nothing): the package runs it on import, so every process of a run and its
    children (torchrun's ranks, loader workers) inherit it. A value the environment already gives is kept."""
    os.environ.setdefault("OPENCV_FOR_THREADS_NUM", "1")


@contextlib.contextmanager
def importing_ffcv():
    """Around every import of ffcv in the package: ``configure()`` first, and torch's thread count (the training
    step's, OMP_NUM_THREADS) kept, which ffcv's first import sets to 1 (its ``Compiler.set_num_threads(1)``).

    ffcv 1.0's ``ffcv.fields.rgb_image`` keeps its two image modes (jpg 0, raw 1) in a numba typed Dict, and
    filling it compiles the typed Dict's insertion: about 7 s of one core in every process that imports ffcv
    (each rank, at every start and requeue), 0.5 s more for its first lookup. The modes are only ever read from
    Python (ffcv's ``generate_code`` and writer, and ours), never inside compiled code, so while ffcv is first
    imported ``from numba.typed import Dict`` gives a plain dict; numba's own Dict is back as soon as the import
    ends.

    On its way out it applies the package's two fixes to ffcv (``_fix_ffcv``), once per process: every module that
    imports ffcv does so inside this context, so none sees ffcv unfixed."""
    import torch

    configure()
    threads = torch.get_num_threads()
    plain_modes = "ffcv.fields.rgb_image" not in sys.modules
    if plain_modes:
        import numba.typed
        import numba.typed.typeddict  # numba's own modules loaded first: only ffcv's see the plain dict

        numba.typed.Dict = dict  # an attribute of the module shadows its lazy __getattr__ for Dict
    try:
        yield
    finally:
        if plain_modes:
            del numba.typed.Dict
        torch.set_num_threads(threads)
    _fix_ffcv()


def _serial(cls, n: int) -> None:
    """ffcv's ``Compiler.set_num_threads(n)`` sets numba's and torch's thread counts to n, for every Loader and
    epoch, and makes the decoders compile with numba's prange over the batch. Here they compile serial: the loader's
    threads run a batch each (``data/ffcv_epoch.py``), and torch's count is the training step's (OMP_NUM_THREADS)."""
    cls.num_threads = 1


def _fix_ffcv() -> None:
    """Serial compilation (``_serial``), and ffcv's ``OSCacheManager`` typed without its side effect: ffcv sets
    ``mutable = False`` on the object ``numba.uint8[::1]`` returns, which is numba's one shared type of every
    writable uint8 vector: from then on such vectors type as read-only in the whole process, a write into one no
    longer compiles, and numba's tables keyed by that type break (a KeyError when a second pipeline calls a
    compiled function a first one called). Here the manager's state and reader use a read-only type of their own."""
    from ffcv.memory_managers.os_cache import OSCacheManager
    from ffcv.pipeline.compiler import Compiler

    if getattr(Compiler, "convit_scale_fixed", False):
        return
    import numba
    import numpy as np

    read_only_bytes = numba.types.Array(numba.uint8, 1, "C", readonly=True)

    def state_type(self):
        return numba.types.Tuple([read_only_bytes, numba.uint64[::1], numba.uint64[::1]])

    def compile_reader(self):
        def read(address, mem_state):
            size = mem_state[2][np.searchsorted(mem_state[1], address)]
            return mem_state[0][address:address + size]

        return Compiler.compile(read, read_only_bytes(numba.uint64, self.state_type))

    Compiler.set_num_threads = classmethod(_serial)
    Compiler.num_threads = 1
    OSCacheManager.state_type = property(state_type)
    OSCacheManager.compile_reader = compile_reader
    Compiler.convit_scale_fixed = True
