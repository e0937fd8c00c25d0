"""Memory per rank (convit_scale/train/memory.py) on the CPU: the peak follows a large allocation and is reset, and
the live tensors count each storage once (views and shared parameters not twice)."""

from __future__ import annotations

import os

import pytest
import torch

from convit_scale.train.memory import peak_memory_mb, reset_peak_memory, tensor_memory_mb

CPU = torch.device("cpu")


@pytest.mark.skipif(not os.access("/proc/self/clear_refs", os.W_OK), reason="peak RSS not resettable here")
def test_the_peak_follows_an_allocation_and_is_reset():
    reset_peak_memory(CPU)
    before = peak_memory_mb(CPU)
    block = torch.ones(64 * 2**20 // 4)  # 64 MiB, written (resident)
    during = peak_memory_mb(CPU)
    assert during >= before + 60
    del block
    reset_peak_memory(CPU)
    assert peak_memory_mb(CPU) < during - 60  # the peak starts again from the resident set


def test_live_tensors_are_counted_once_per_storage():
    module = torch.nn.Linear(1024, 1024, bias=False)  # 4 MiB of weights
    base = tensor_memory_mb(CPU, module)
    big = torch.zeros(8 * 2**20 // 4)  # 8 MiB
    views = [big[: 2**20], big.view(2, -1)]  # the same storage: nothing more
    assert abs(tensor_memory_mb(CPU, module) - base - 8) < 0.5
    module(torch.ones(2, 1024)).sum().backward()  # the weight's gradient: 4 MiB more
    assert abs(tensor_memory_mb(CPU, module) - base - 12) < 0.5
    del big, views
