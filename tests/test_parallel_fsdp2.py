"""parallel/fsdp2.py: the ranks of a node, read from the launcher's environment (the HSDP mesh's shard size), and
FSDP2 at one rank training exactly as the plain module does."""

from __future__ import annotations

import torch
from support import built_strategy, one_rank_group, strategy_step

from convit_scale.parallel.fsdp2 import ranks_per_node

CPU = torch.device("cpu")
LAUNCHER_VARS = ("LOCAL_WORLD_SIZE", "SLURM_STEP_TASKS_PER_NODE", "SLURM_NTASKS_PER_NODE", "SLURM_TASKS_PER_NODE")


def test_ranks_per_node_from_torchrun_then_srun_then_the_world(monkeypatch):
    for key in LAUNCHER_VARS:
        monkeypatch.delenv(key, raising=False)
    assert ranks_per_node(24) == 24  # no launcher says: one node
    monkeypatch.setenv("SLURM_TASKS_PER_NODE", "8(x3)")  # Slurm's compressed form: 8 on each of 3 nodes
    assert ranks_per_node(24) == 8
    monkeypatch.setenv("SLURM_STEP_TASKS_PER_NODE", "4(x6)")  # the step's own count comes before the job's
    assert ranks_per_node(24) == 4
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")  # torchrun's, first of all
    assert ranks_per_node(24) == 2


def test_fsdp2_on_one_rank_steps_as_the_plain_module():
    """Sharding over one rank changes nothing: after the same steps, the same weights as parallel.strategy=none."""
    with one_rank_group(CPU):
        plain = built_strategy(CPU, "parallel.strategy=none", "parallel.precision=fp32")
        sharded = built_strategy(CPU, "parallel.strategy=fsdp2", "parallel.precision=fp32")
        for seed in range(2):
            for s in (plain, sharded):
                strategy_step(s, CPU, seed=seed)
        full = sharded.full_state_dict()
        for name, value in plain.module.state_dict().items():
            torch.testing.assert_close(full[name], value, rtol=1e-5, atol=1e-6, msg=name)
