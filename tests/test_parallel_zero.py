"""convit_scale/parallel/zero.py: DeepSpeed on the rank's own GPU, and the ZeRO config the engine writes."""

from __future__ import annotations

import types

import pytest
import torch

from convit_scale.parallel.zero import deepspeed_args
from convit_scale.train.distributed import device_for


def test_deepspeed_takes_the_ranks_gpu_not_local_rank(monkeypatch):
    """A site that gives each task one GPU (`--gpus-per-task=1`): local rank 5 sees one device, cuda:0. The engine's
    own choice (LOCAL_RANK) would be the invalid ordinal 5; with the args the strategy passes, DeepSpeed's engine sets
    the device the process group uses."""
    import deepspeed.runtime.engine as engine

    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    ours = device_for(5)
    assert ours == torch.device("cuda", 0)

    chosen = []
    accelerator = types.SimpleNamespace(set_device=chosen.append, device_name=lambda i: f"cuda:{i}",
                                        device=lambda: "cuda")
    monkeypatch.setattr(engine, "get_accelerator", lambda: accelerator)
    monkeypatch.setattr(engine.dist, "get_world_size", lambda: 8)
    monkeypatch.setattr(engine.dist, "get_rank", lambda: 5)
    stub = types.SimpleNamespace(local_rank=5)
    engine.DeepSpeedEngine._set_distributed_vars(stub, deepspeed_args(ours))  # DeepSpeed's own code, our args
    assert chosen == [0] and stub.device == ours
    engine.DeepSpeedEngine._set_distributed_vars(stub, None)  # what it did before: LOCAL_RANK
    assert chosen == [0, 5]
    assert deepspeed_args(torch.device("cpu")) is None  # on the CPU DeepSpeed's accelerator has no device to pick


def test_a_zero3_checkpoint_is_converted_only_by_a_deepspeed_that_can():
    """DeepSpeed before 0.19 fails converting ZeRO-3 partitions (0.16.0, 0.17.0): refused with what to do instead."""
    from convit_scale.parallel.zero import universal_problem

    assert universal_problem("zero3", "0.19.8") is None and universal_problem("zero2", "0.16.0") is None
    problem = universal_problem("zero3", "0.17.0+cpu")
    assert "DeepSpeed >= 0.19 (installed: 0.17.0+cpu)" in problem and "resume on the world size" in problem


def test_buckets_sized_from_the_model_are_aligned_and_odd_ones_refused():
    """A tenth of ConViT-B+ (153,134,856 parameters) is odd, which DeepSpeed's ZeRO-1/2 refuse at start-up on every
    rank ("allgather_bucket_size must be a multiple of nccl_start_alignment_factor"): rounded up to a multiple of 8;
    an explicit odd size is refused with the recipe."""
    from convit_scale.config import ConfigError, load_config
    from convit_scale.parallel.zero import zero_sizes

    for device in ("cpu", "cuda"):
        bucket = zero_sizes(load_config(None, ["parallel.strategy=zero2"]).parallel, 153_134_856, device)["bucket"]
        assert bucket % 8 == 0 and 0 <= bucket - 153_134_856 / 10 < 8
    with pytest.raises(ConfigError, match="parallel.zero_bucket_elements = 1001 is not allowed; must be a positive "
                                          "multiple of 8"):
        load_config(None, ["parallel.strategy=zero2", "parallel.zero_bucket_elements=1001"])
