"""splitmix64 in numba, for compiled loader stages: the same draws as ``splitmix.py``'s torch ops, bit for bit.

FFCV's decoders run compiled (numba), one image at a time, where torch cannot run; they draw a view's
RandomResizedCrop and flip from its seed with these functions, which give exactly ``splitmix.draw(keys_of(seed),
counter)`` (``tests/test_splitmix.py``). The counters are ``DECODE_COUNTER + k``: far from the per-sample draws of
the device augmentation (counters from 0) and of drop-path (``models.convit.DROP_PATH_COUNTER``), which key on the
same seeds.

``seeded_crop`` and ``flipped`` (a view's RandomResizedCrop box and flip, ``data/sample.py``'s contract) live here
with the generator because every function here is cached on disk by numba: every training process needs them at
start-up (``sample.compile_draws``), every rank of a job at every requeue, and numba's cache turns their compilation
into a load. Numba invalidates a cached function only when its own file changes, so a cached
function calls and reads nothing defined in another file of the package (``tests/test_structure.py``). The cache
lies in ``__pycache__`` beside this file, or in the user's cache folder where the package's folder is read-only
(numba's rule; ``NUMBA_CACHE_DIR`` overrides both); where neither is writable the functions are compiled in each
process (``CACHE``). Its entries are keyed by numba's version and the CPU: a cluster of mixed nodes keeps one per
kind of CPU.
"""

from __future__ import annotations

import numba
import numpy as np

DECODE_COUNTER = 1 << 36
"""The first counter of the decoders' draws (crop: 4 per attempt, 10 attempts; flip: ``FLIP_DRAW``)."""
FLIP_DRAW = 40
"""The flip's draw: ``uniform(seed, FLIP_DRAW) < p``."""


def cache_available(probe) -> bool:
    """Whether numba can cache the compiled functions of ``probe``'s file: the package's ``__pycache__``, the user's
    cache folder or ``NUMBA_CACHE_DIR`` is writable. Where none is (a read-only install, a container, no writable
    home), ``numba.njit(cache=True)`` fails the module's import; the functions are then compiled in each process."""
    try:
        numba.njit(cache=True)(probe)
    except RuntimeError:  # numba: "cannot cache function ...: no locator available for file ..."
        return False
    return True


CACHE = cache_available(lambda: 0)
"""Whether this file's functions are cached on disk (``cache_available``)."""

_GOLDEN = np.uint64(0x9E3779B97F4A7C15)
_MUL1 = np.uint64(0xBF58476D1CE4E5B9)
_MUL2 = np.uint64(0x94D049BB133111EB)


@numba.njit(nogil=True, cache=CACHE)
def mix64(z):
    """splitmix64's finaliser on a uint64 (``splitmix.mix64``)."""
    z = (z ^ (z >> np.uint64(30))) * _MUL1
    z = (z ^ (z >> np.uint64(27))) * _MUL2
    return z ^ (z >> np.uint64(31))


@numba.njit(nogil=True, cache=CACHE)
def draw(seed, counter):
    """The ``counter``-th splitmix64 output of ``seed``'s key (``splitmix.draw(splitmix.keys_of(seed), counter)``)."""
    key = mix64(np.uint64(seed) + _GOLDEN)
    return mix64(key + (np.uint64(counter) + np.uint64(1)) * _GOLDEN)


@numba.njit(nogil=True, cache=CACHE)
def uniform(seed, k):
    """The k-th decoder draw of a view in [0, 1): the top 53 bits of its ``DECODE_COUNTER + k``-th output, as the
    device augmentation turns its draws into floats."""
    return (draw(seed, np.uint64(DECODE_COUNTER) + np.uint64(k)) >> np.uint64(11)) * (1.0 / 9007199254740992.0)


@numba.njit(nogil=True, cache=CACHE)
def seeded_crop(height, width, scale, log_ratio, view_seed):
    """RandomResizedCrop's parameters (i, j, h, w), as torchvision and timm draw them (10 attempts of an area in
    ``scale`` and a log-uniform ratio, else the centre crop of the clamped ratio), each draw a splitmix draw of the
    view's seed."""
    area = height * width
    for attempt in range(10):
        target_area = area * (scale[0] + (scale[1] - scale[0]) * uniform(view_seed, 4 * attempt))
        aspect_ratio = np.exp(log_ratio[0] + (log_ratio[1] - log_ratio[0]) * uniform(view_seed, 4 * attempt + 1))
        w = int(round(np.sqrt(target_area * aspect_ratio)))
        h = int(round(np.sqrt(target_area / aspect_ratio)))
        if 0 < w <= width and 0 < h <= height:
            i = int(uniform(view_seed, 4 * attempt + 2) * (height - h + 1))
            j = int(uniform(view_seed, 4 * attempt + 3) * (width - w + 1))
            return i, j, h, w
    in_ratio = float(width) / float(height)  # fallback: the centre crop of the clamped ratio
    w, h = int(width), int(height)
    if in_ratio < np.exp(log_ratio[0]):
        h = int(round(w / np.exp(log_ratio[0])))
    elif in_ratio > np.exp(log_ratio[1]):
        w = int(round(h * np.exp(log_ratio[1])))
    return (int(height) - h) // 2, (int(width) - w) // 2, h, w


@numba.njit(nogil=True, cache=CACHE)
def flipped(view_seed, p):
    """Whether the view is flipped horizontally (probability ``p``)."""
    return uniform(view_seed, FLIP_DRAW) < p
