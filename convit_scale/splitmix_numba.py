"""splitmix64 in numba, for compiled loader stages: the same draws as ``splitmix.py``'s torch ops, bit for bit.

FFCV's decoders run compiled (numba), one image at a time, where torch cannot run; they draw a view's
RandomResizedCrop and flip from its seed with these functions, which give exactly ``splitmix.draw(keys_of(seed),
counter)`` (``tests/test_splitmix.py``). The counters are ``DECODE_COUNTER + k``: far from the per-sample draws of
the device augmentation (counters from 0) and of drop-path (``models.convit.DROP_PATH_COUNTER``), which key on the
same seeds.
"""

from __future__ import annotations

import numba
import numpy as np

DECODE_COUNTER = 1 << 36
"""The first counter of the decoders' draws (crop: 4 per attempt, 10 attempts; flip: ``FLIP_DRAW``)."""
FLIP_DRAW = 40
"""The flip's draw: ``uniform(seed, FLIP_DRAW) < p``."""

_GOLDEN = np.uint64(0x9E3779B97F4A7C15)
_MUL1 = np.uint64(0xBF58476D1CE4E5B9)
_MUL2 = np.uint64(0x94D049BB133111EB)


@numba.njit(nogil=True)
def mix64(z):
    """splitmix64's finaliser on a uint64 (``splitmix.mix64``)."""
    z = (z ^ (z >> np.uint64(30))) * _MUL1
    z = (z ^ (z >> np.uint64(27))) * _MUL2
    return z ^ (z >> np.uint64(31))


@numba.njit(nogil=True)
def draw(seed, counter):
    """The ``counter``-th splitmix64 output of ``seed``'s key (``splitmix.draw(splitmix.keys_of(seed), counter)``)."""
    key = mix64(np.uint64(seed) + _GOLDEN)
    return mix64(key + (np.uint64(counter) + np.uint64(1)) * _GOLDEN)


@numba.njit(nogil=True)
def uniform(seed, k):
    """The k-th decoder draw of a view in [0, 1): the top 53 bits of its ``DECODE_COUNTER + k``-th output, as the
    device augmentation turns its draws into floats."""
    return (draw(seed, np.uint64(DECODE_COUNTER) + np.uint64(k)) >> np.uint64(11)) * (1.0 / 9007199254740992.0)
