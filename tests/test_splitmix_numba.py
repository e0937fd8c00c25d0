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


def test_without_a_writable_cache_folder_the_draws_compile_in_each_process():
    """A read-only install with no writable home: numba finds no folder to cache in (emulated: no cache locator),
    and the module still imports, its functions compiled in the process, the same draws."""
    import subprocess
    import sys

    probe = ("import numba.core.caching as c; c.CacheImpl._locator_classes = []\n"
             "import numpy as np; from convit_scale import splitmix_numba as s\n"
             "assert s.CACHE is False and s.cache_available(lambda: 0) is False\n"
             "print(s.seeded_crop(np.uint32(100), np.uint32(80), np.array([0.08, 1.0]), np.array([-0.3, 0.3]), "
             "np.uint64(7)), bool(s.flipped(np.uint64(7), 0.5)))")
    cached = subprocess.run([sys.executable, "-c", probe.replace("c.CacheImpl._locator_classes = []", "pass")
                             .replace("s.CACHE is False and s.cache_available(lambda: 0) is False", "s.CACHE")],
                            capture_output=True, text=True)
    uncached = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True)
    assert uncached.returncode == 0, uncached.stderr[-2000:]
    assert cached.returncode == 0, cached.stderr[-2000:]
    assert uncached.stdout == cached.stdout and "(" in uncached.stdout
