"""The accelerators the planner and `bench mfu` know (convit_scale/hardware.py): a CUDA device name to its dense
peak, the longest marker first, and the CPUs this process may use."""

from __future__ import annotations

import os

import pytest

from convit_scale.hardware import GPUS, peak_tflops_of, usable_cpus


@pytest.mark.parametrize("name, peak", [
    ("NVIDIA H100 80GB HBM3", 989), ("NVIDIA H200", 989), ("NVIDIA GH200 480GB", 989),
    ("NVIDIA A100-SXM4-80GB", 312), ("NVIDIA A100-SXM4-40GB", 312), ("Tesla V100-SXM2-32GB", 125),
    ("NVIDIA L40S", 362), ("NVIDIA L4", 121), ("NVIDIA A10", 125), ("AMD Instinct MI300X", 1307),
    ("nvidia l40s", 362),  # names compared upper-case
])
def test_a_device_name_gives_its_dense_peak(name, peak):
    assert peak_tflops_of(name) == peak


def test_an_unknown_device_has_no_peak():
    assert peak_tflops_of("NVIDIA GeForce RTX 3090") is None and peak_tflops_of("cpu") is None


def test_markers_are_unique_and_links_positive():
    markers = [g.marker for g in GPUS.values() if g.marker]
    assert len(markers) == len(set(markers))
    assert all(g.intra_gbytes_s > 0 and g.inter_gbytes_s > 0 and g.memory_gib > 0 for g in GPUS.values())


def test_usable_cpus_are_the_affinity_mask():
    assert usable_cpus() == len(os.sched_getaffinity(0)) <= os.cpu_count()
