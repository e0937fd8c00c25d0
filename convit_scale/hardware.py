"""The accelerators the planner and `bench mfu` know: memory and dense peak, from the vendors' data sheets.

Peaks are dense 16-bit tensor-core TFLOP/s: bf16, except the V100, which has none and is listed at fp16.
"""

from __future__ import annotations

import os
from typing import NamedTuple


def usable_cpus() -> int:
    """The CPUs this process may run on: a Slurm allocation's (its cgroup's affinity mask), not the node's."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


class Gpu(NamedTuple):
    memory_gib: float
    peak_tflops: float
    marker: str | None  # what torch.cuda.get_device_name() contains; None: never matched by name


GPUS = {  # `convit-scale plan --gpu NAME`
    "h100-80gb": Gpu(80, 989, "H100"), "h200-141gb": Gpu(141, 989, "H200"), "gh200-96gb": Gpu(96, 989, "GH200"),
    "a100-80gb": Gpu(80, 312, "A100"), "a100-40gb": Gpu(40, 312, None), "l40s-48gb": Gpu(48, 362, "L40S"),
    "l4-24gb": Gpu(24, 121, "L4"), "a10-24gb": Gpu(24, 125, "A10"), "v100-32gb": Gpu(32, 125, "V100"),
    "mi300x-192gb": Gpu(192, 1307, "MI300X"),
    "cpu": Gpu(24, 1, None),  # this project's CPU machines: the planner checked against the engine there
}


def peak_tflops_of(device_name: str) -> float | None:
    """The dense peak of a device by its CUDA name ("NVIDIA H200"), or None for a GPU not in ``GPUS``."""
    name = device_name.upper()
    markers = sorted((g.marker for g in GPUS.values() if g.marker), key=len, reverse=True)  # "GH200" before "H200"
    for marker in markers:
        if marker in name:
            return next(g.peak_tflops for g in GPUS.values() if g.marker == marker)
    return None
