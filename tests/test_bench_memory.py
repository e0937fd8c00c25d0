"""`bench memory` (convit_scale/bench/memory.py): the ZeRO sizes it pins are CPU's on any device."""

import math

import pytest
import torch

from convit_scale.bench import memory
from convit_scale.config import load_config
from convit_scale.parallel.zero_config import deepspeed_config


@pytest.mark.parametrize("strategy", ["ddp", "zero1", "zero2", "zero3"])
def test_memory_bench_pins_the_cpu_zero_sizes(strategy):
    """The overrides `bench memory` passes are valid and give the CPU sizes even where CUDA defaults apply."""
    params = 153_000_000
    overrides = memory.zero_overrides(strategy, params)
    if strategy == "ddp":
        assert overrides == []
        return
    cfg = load_config(None, [f"parallel.strategy={strategy}", *overrides])
    default = load_config(None, [f"parallel.strategy={strategy}"])
    pinned = deepspeed_config(cfg.parallel, 2, 1, 2, params, device=torch.device("cuda"))["zero_optimization"]
    cpu = deepspeed_config(default.parallel, 2, 1, 2, params, device=torch.device("cpu"))["zero_optimization"]
    for zero in (pinned, cpu):  # sub-groups have no key: on CUDA they stay DeepSpeed's
        zero.pop("sub_group_size", None)
    assert pinned == cpu and cpu["reduce_bucket_size"] == math.floor(params / 10)
