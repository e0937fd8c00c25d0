"""splitmix64 in numba (convit_scale/splitmix_numba.py), the FFCV decoders' generator: the published SplitMix64
outputs, and the decoders' counters apart from every other draw of a sample's seed (that its draws are torch's,
bit for bit, is tested in test_splitmix.py)."""

from __future__ import annotations

import numpy as np

from convit_scale.splitmix_numba import mix64


def test_mix64_gives_the_published_splitmix64_outputs():
    """SplitMix64 seeded with 0 (Vigna's reference splitmix64.c): outputs 1 to 3 are mix64(k * golden ratio)."""
    golden = 0x9E3779B97F4A7C15
    outputs = [int(mix64(np.uint64(k * golden % 2**64))) for k in (1, 2, 3)]
    assert outputs == [0xE220A8397B1DCDAF, 0x6E789E6AA1B965F4, 0x06C45D188009454F]


def test_decoder_counters_are_apart_from_the_others():
    """Crop and flip draw from a sample's seed, as the device augmentation (counters from 0) and drop-path do: their
    counter ranges must not meet, or a crop and a RandAugment choice would be the same number."""
    from convit_scale.models.convit import DROP_PATH_COUNTER
    from convit_scale.splitmix_numba import DECODE_COUNTER, FLIP_DRAW

    assert 10_000 < DECODE_COUNTER and DECODE_COUNTER + FLIP_DRAW < DROP_PATH_COUNTER


def test_the_crops_draws_end_before_the_flips():
    """seeded_crop draws 4 numbers per attempt for at most 10 attempts (counters 0..39): the flip's is after them."""
    from convit_scale.splitmix_numba import FLIP_DRAW

    assert FLIP_DRAW >= 4 * 10
