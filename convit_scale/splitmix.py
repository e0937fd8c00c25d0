"""splitmix64 in int64 torch ops: the one counter-based hash behind every augmentation seed and random draw.

A draw is a pure function of (key, counter), never a position in an RNG stream, so a resumed epoch, another
world size or another device gives the same numbers. Works on CPU and CUDA tensors alike (wrapping int64
multiply, logical shifts by masking).
"""

from __future__ import annotations

import torch


def as_int64(value: int) -> int:
    """The int64 with the same 64 bits as ``value`` mod 2**64."""
    value %= 1 << 64
    return value - (1 << 64) if value >= 1 << 63 else value


GOLDEN = as_int64(0x9E3779B97F4A7C15)
_MUL1 = as_int64(0xBF58476D1CE4E5B9)
_MUL2 = as_int64(0x94D049BB133111EB)


def srl(z: torch.Tensor, k: int) -> torch.Tensor:
    """Logical right shift of int64 bits (torch's >> is arithmetic)."""
    return (z >> k) & ((1 << (64 - k)) - 1)


def mix64(z: torch.Tensor) -> torch.Tensor:
    """splitmix64's finaliser: a bijection of 64-bit words with full avalanche."""
    z = (z ^ srl(z, 30)) * _MUL1
    z = (z ^ srl(z, 27)) * _MUL2
    return z ^ srl(z, 31)


def keys_of(seeds: torch.Tensor) -> torch.Tensor:
    """One 64-bit key per seed (splitmix64's first output for that seed)."""
    return mix64(seeds.to(torch.int64) + GOLDEN)


def draw(keys: torch.Tensor, counters: torch.Tensor) -> torch.Tensor:
    """The ``counters``-th splitmix64 output of each key (broadcast against each other)."""
    return mix64(keys + (counters + 1) * GOLDEN)
