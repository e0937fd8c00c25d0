"""The counter-based generator: torch's (``splitmix.py``) and numba's (``splitmix_numba.py``, the FFCV decoders')
give the same bits for the same seed and counter, and both are splitmix64."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from convit_scale.splitmix import draw, keys_of, srl

MASK = (1 << 64) - 1
SEEDS = [0, 1, 7, 12345, 2**31 - 1, 2**40 + 3]


def _textbook(seed: int, counter: int) -> int:
    """splitmix64: the key is the first output for the seed; the draw is the key's (counter + 1)-th state mixed."""
    def mix(z):
        z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & MASK
        z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & MASK
        return z ^ (z >> 31)

    key = mix((seed + 0x9E3779B97F4A7C15) & MASK)
    return mix((key + (counter + 1) * 0x9E3779B97F4A7C15) & MASK)


@pytest.mark.parametrize("seed", SEEDS)
def test_numba_draws_are_torchs(seed):
    from convit_scale import splitmix_numba as jit

    counters = [0, 1, 5, 40, jit.DECODE_COUNTER, jit.DECODE_COUNTER + 39, 1 << 40]
    ours = [int(jit.draw(np.uint64(seed), np.uint64(c))) for c in counters]
    theirs = draw(keys_of(torch.tensor([seed])), torch.tensor(counters))
    assert [x & MASK for x in theirs.tolist()] == ours == [_textbook(seed, c) for c in counters]
    for k in range(41):  # the decoders' uniforms: the top 53 bits of their counters' draws
        u = srl(draw(keys_of(torch.tensor([seed])), torch.tensor([jit.DECODE_COUNTER + k])), 11).double() * 2.0 ** -53
        assert jit.uniform(np.uint64(seed), k) == u.item()
