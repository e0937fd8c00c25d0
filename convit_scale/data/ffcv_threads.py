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


def configure() -> None:
    """Idempotent and cheap (imports nothing): the package runs it on import, so every process of a run and its
    children (torchrun's ranks, loader workers) inherit it. A value the environment already gives is kept."""
    os.environ.setdefault("OPENCV_FOR_THREADS_NUM", "1")


@contextlib.contextmanager
def importing_ffcv():
    """Around every import of ffcv in the package: ``configure()`` first, and torch's thread count (the training
    step's, OMP_NUM_THREADS) kept, which ffcv's first import sets to 1 (its ``Compiler.set_num_threads(1)``)."""
    import torch

    configure()
    threads = torch.get_num_threads()
    try:
        yield
    finally:
        torch.set_num_threads(threads)
