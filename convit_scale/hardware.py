"""The accelerators the planner and `bench mfu` know: memory, dense peak and links, from the vendors' data sheets.

Peaks are dense 16-bit tensor-core TFLOP/s: bf16, except the V100, which has none and is listed at fp16.

Links are GB/s (bytes) per GPU in one direction, at their signalling rate: ``intra_gbytes_s`` to the other GPUs of its
node (NVLink, xGMI or PCIe; a data sheet's bidirectional "900 GB/s" is 450 here), ``inter_gbytes_s`` to other nodes:
the NIC bandwidth a GPU has in the vendor's reference node (a 400 Gb/s ConnectX-7 per GPU is 50). Sites differ:
``convit-scale plan --intra-gbytes-per-s / --inter-gbytes-per-s`` take a cluster's own figures (nccl-tests' busbw:
within a node; across nodes divided by the GPUs of a node, whose NICs a ring shares). Sources:
- H100 SXM5 / H200 SXM: NVLink 4, 900 GB/s bidirectional (H100 and H200 data sheets); DGX H100 / DGX H200: eight
  single-port ConnectX-7 at 400 Gb/s, one per GPU (DGX H100/H200 data sheet, "Networking").
- GH200: 18 NVLink-4 links, 900 GB/s bidirectional (GH200 data sheet); nodes of four superchips with one 200 Gb/s
  NIC each (HPE Cray EX254n, as in CSCS Alps): sites with a 400 Gb/s NIC per superchip should pass 50.
- A100 SXM4: NVLink 3, 600 GB/s bidirectional (A100 data sheet); DGX A100: eight 200 Gb/s HDR ConnectX-6, one per
  GPU (DGX A100 data sheet).
- V100 SXM: NVLink 2, 300 GB/s bidirectional (V100 data sheet); DGX-1V: four 100 Gb/s EDR ports for eight GPUs,
  12.5 GB/s per two GPUs (DGX-1 data sheet).
- MI300X: seven Infinity Fabric (xGMI) links of 128 GB/s bidirectional, 896 GB/s (MI300X data sheet); one 400 Gb/s
  NIC per GPU (Azure ND MI300X v5, AMD's MI300X platform reference).
- L40S, L4, A10: PCIe Gen4 x16, 64 GB/s bidirectional, no NVLink (their data sheets); PCIe cards have no vendor
  reference node: one 100 Gb/s NIC per GPU is assumed (pass the cluster's own figure).
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
    intra_gbytes_s: float  # to the node's other GPUs, per GPU, one direction (NVLink, xGMI, PCIe)
    inter_gbytes_s: float  # to other nodes, per GPU, one direction (its share of the node's NICs)
    intra_link: str  # what ``intra_gbytes_s`` is


GPUS = {  # `convit-scale plan --gpu NAME`
    "h100-80gb": Gpu(80, 989, "H100", 450, 50, "NVLink 4"),
    "h200-141gb": Gpu(141, 989, "H200", 450, 50, "NVLink 4"),
    "gh200-96gb": Gpu(96, 989, "GH200", 450, 25, "NVLink 4"),
    "a100-80gb": Gpu(80, 312, "A100", 300, 25, "NVLink 3"),
    "a100-40gb": Gpu(40, 312, None, 300, 25, "NVLink 3"),
    "l40s-48gb": Gpu(48, 362, "L40S", 32, 12.5, "PCIe 4"),
    "l4-24gb": Gpu(24, 121, "L4", 32, 12.5, "PCIe 4"),
    "a10-24gb": Gpu(24, 125, "A10", 32, 12.5, "PCIe 4"),
    "v100-32gb": Gpu(32, 125, "V100", 150, 6.25, "NVLink 2"),
    "mi300x-192gb": Gpu(192, 1307, "MI300X", 448, 50, "xGMI"),
    # this project's CPU machines, where the planner is checked against the engine (memory, bytes of collectives);
    # gloo over loopback: rough figures, no time the planner gives for them is checked
    "cpu": Gpu(24, 1, None, 10, 1.25, "loopback"),
}

LINK_EFFICIENCY = 0.8
"""Share of a link's data-sheet rate a ring collective moves (protocol headers, chunk pipelining). nccl-tests'
busbw reaches the rate or more only with in-switch/in-network reduction (NVLink SHARP, SHARP: 460-480 GB/s
all-reduce busbw on 8 x H100 SXM against NVLink 4's 450 per direction, and 400-450 across H100/H200 nodes with
eight 400 Gb/s NICs, in published nccl-tests guides); FSDP's all-gathers and reduce-scatters are plain rings."""


def peak_tflops_of(device_name: str) -> float | None:
    """The dense peak of a device by its CUDA name ("NVIDIA H200"), or None for a GPU not in ``GPUS``."""
    name = device_name.upper()
    markers = sorted((g.marker for g in GPUS.values() if g.marker), key=len, reverse=True)  # "GH200" before "H200"
    for marker in markers:
        if marker in name:
            return next(g.peak_tflops for g in GPUS.values() if g.marker == marker)
    return None
