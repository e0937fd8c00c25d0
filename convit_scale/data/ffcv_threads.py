"""How ffcv's native code uses threads, set before ffcv is first imported in a process (``configure()``).

Measured with ``convit-scale bench data`` (the FFCV loader's images/s from 1 to 2 workers on 2 cores):

- numba runs the decoders' ``prange`` loops over a threading layer fixed at its first parallel launch, and
  importing ffcv launches it (``Compiler.set_num_threads`` at import). numba's default, TBB first, gave 1.3-1.6x;
  GNU OpenMP gave 1.8-2.1x. OpenMP comes first unless ``NUMBA_THREADING_LAYER(_PRIORITY)`` names a choice.
- The decoders call OpenCV's resize from each of their ``num_workers`` threads, and OpenCV would run every
  resize on a pool of its own with one thread per core: workers x cores threads per rank, ranks x that per
  node. ``OPENCV_FOR_THREADS_NUM=1`` (read when OpenCV loads, with ffcv's library) keeps one per worker.
"""

from __future__ import annotations

import os
import sys


def configure() -> None:
    """Idempotent and cheap (imports nothing): the package runs it on import, so every process of a run and its
    children (torchrun's ranks, loader workers) inherit it. A value the environment already gives is kept."""
    os.environ.setdefault("OPENCV_FOR_THREADS_NUM", "1")
    if "NUMBA_THREADING_LAYER" in os.environ:
        return
    os.environ.setdefault("NUMBA_THREADING_LAYER_PRIORITY", "omp tbb workqueue")
    config = sys.modules.get("numba.core.config")  # numba read its environment when imported
    if config is not None:
        config.THREADING_LAYER_PRIORITY = os.environ["NUMBA_THREADING_LAYER_PRIORITY"].split()
