"""How ffcv's native code uses threads, set before ffcv is first imported in a process (``configure()``).

The FFCV loader's ``num_workers`` threads each decode whole batches (``ffcv._EpochIterator``) and call OpenCV's
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
    ends."""
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
