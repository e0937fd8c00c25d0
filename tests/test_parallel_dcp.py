"""parallel/dcp.py: model and optimizer state through torch.distributed.checkpoint, saved by one strategy and loaded
by another (DCP reshards: DDP's checkpoint into FSDP2, as an elastic resume across strategies of that family does)."""

from __future__ import annotations

import torch
from support import built_strategy, one_rank_group, strategy_step

CPU = torch.device("cpu")


def test_a_saved_state_loads_back_exactly_and_into_another_strategy(tmp_path):
    with one_rank_group(CPU):
        ddp = built_strategy(CPU, "parallel.strategy=ddp", "parallel.precision=fp32")
        strategy_step(ddp, CPU)
        ddp.save(tmp_path)
        saved = {k: v.clone() for k, v in ddp.module.state_dict().items()}
        moments = [t.clone() for t in ddp.optimizer_tensors()]
        strategy_step(ddp, CPU, seed=1)  # moves on: the load must bring the saved state back
        ddp.load(tmp_path, 1)
        assert all(torch.equal(ddp.module.state_dict()[k], v) for k, v in saved.items())
        assert all(torch.equal(a, b) for a, b in zip(ddp.optimizer_tensors(), moments))
        fsdp2 = built_strategy(CPU, "parallel.strategy=fsdp2", "parallel.precision=fp32")
        fsdp2.load(tmp_path, 1)
        full = fsdp2.full_state_dict()
        assert all(torch.equal(full[k], v) for k, v in saved.items())
