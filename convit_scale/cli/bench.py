"""``convit-scale bench``: registered by the benchmarks themselves (convit_scale/bench.py)."""

from __future__ import annotations


def register(sub) -> None:
    from .. import bench

    bench.add_subcommand(sub)
