"""convit_scale/parallel/zero.py: the ZeRO strategy on its rank's device (LOCAL_RANK as DeepSpeed reads it), the best
weights from the fp32 master under bf16, the optimizer state after a universal load, DeepSpeed's bf16 check off.

One rank in this process (a one-process gloo group): what these check does not depend on the world size."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
from support import (
    built_strategy,
    one_rank_group,
    records,
    strategy_step,
    tiny_recipe,
    train_here,
    universal_state_placement,
)

CPU = torch.device("cpu")


def test_deepspeed_sees_the_local_rank_of_the_ranks_device(monkeypatch):
    """A site that gives each task one GPU starts local rank 3 with LOCAL_RANK=3 and one visible device; ZeRO-3's
    ``zero.Init`` builds its device from LOCAL_RANK itself (cuda:3: "invalid device ordinal"). On the CPU the device
    has index 0: DeepSpeed must read LOCAL_RANK=0 while the engine runs, and the launcher's value comes back after."""
    from deepspeed.runtime.zero.partition_parameters import Init

    seen = []
    init = Init.__init__

    def spy(self, *args, **kwargs):
        seen.append(os.environ.get("LOCAL_RANK"))
        init(self, *args, **kwargs)

    monkeypatch.setattr(Init, "__init__", spy)
    with one_rank_group(CPU, local_rank=3) as ctx:
        assert ctx.local_rank == 3
        strategy = built_strategy(CPU, "parallel.strategy=zero3", "parallel.precision=bf16")
        try:
            assert seen == ["0"] and os.environ["LOCAL_RANK"] == "0"
            assert strategy._engine.device == CPU
            strategy_step(strategy, CPU)  # ZeRO-3's first-step trace checks read it too
        finally:
            strategy.close()
        assert os.environ["LOCAL_RANK"] == "3"


def test_deepspeeds_own_bf16_overflow_check_is_off_where_its_release_has_the_switch():
    """The strategy decides a bad step itself (its gate); DeepSpeed's ZeRO-1/2 bf16 check would repeat it with an
    all-reduce and a host read per step. A release without the switch (0.16: no bf16 check) gets no key."""
    from convit_scale.parallel.zero_engine import knows_bf16_overflow_switch

    with one_rank_group(CPU):
        strategy = built_strategy(CPU, "parallel.strategy=zero2", "parallel.precision=bf16")
        try:
            check = getattr(strategy.optimizer, "check_grad_overflow", None)
            assert check is (False if knows_bf16_overflow_switch() else None)
        finally:
            strategy.close()


@pytest.mark.parametrize("strategy", ["zero2", "zero3"])
def test_a_universal_load_puts_the_optimizer_state_where_torch_keeps_it(strategy, tmp_path):
    """With the GPU runs' ZeRO settings (bf16, persistence threshold 1e5, overlapped reduction, fused AdamW): after a
    universal load every state tensor is where torch's ``load_state_dict`` puts it, ``step`` float32 on the parameter's
    device, the moments in the parameter's dtype on its device, and the next step runs. On the CPU host and device are
    one (tests/test_gpu.py checks the same on a GPU, where DeepSpeed's CPU ``step`` was an illegal memory access)."""
    import deepspeed

    from convit_scale.parallel.universal import universal_problem

    if universal_problem(strategy, deepspeed.__version__):
        pytest.skip(universal_problem(strategy, deepspeed.__version__))
    zero3 = ["parallel.zero_param_persistence_threshold=100000"] if strategy == "zero3" else []
    with one_rank_group(CPU):
        placed = universal_state_placement(CPU, tmp_path, f"parallel.strategy={strategy}", "parallel.precision=bf16",
                                           "parallel.zero_overlap_comm=true", "optim.fused=true", *zero3)
    assert {key for key, *_ in placed} == {"step", "exp_avg", "exp_avg_sq"}
    for key, dtype, device, param_dtype, param_device, fused in placed:
        assert fused and device == param_device, (key, device, param_device)
        assert dtype == (torch.float32 if key == "step" else param_dtype), (key, dtype, param_dtype)


@pytest.mark.parametrize("strategy", ["zero2", "zero3"])
def test_best_holds_the_fp32_master_weights_under_bf16(strategy, fm_tree, tmp_path):
    """``checkpoints/best`` is the model in fp32 as ``export`` writes it: DeepSpeed's fp32 master partitions (read back
    from the run's last checkpoint, of the same step), not the bf16 copy the engine computes with."""
    from safetensors.torch import load_file

    from convit_scale.models import create_model
    from convit_scale.trained import consolidate

    r = tiny_recipe(tmp_path / "r.yaml", "imagefolder", fm_tree, tmp_path / "out", parallel={
        "strategy": strategy, "precision": "bf16"}, data={"mixup": 0.0, "cutmix": 0.0}, schedule={"max_steps": 3})
    assert train_here(r) == 0
    (end,) = records(tmp_path / "out", "end")
    best = load_file(str(tmp_path / "out" / "checkpoints" / "best" / "model.safetensors"))
    master = consolidate(Path(end["checkpoint"]))
    weights = [n for n, _ in create_model("convit_nano", num_classes=10, device="meta").named_parameters()]
    assert all(torch.equal(best[k], master[k]) for k in weights), \
        [k for k in weights if not torch.equal(best[k], master[k])][:5]
    assert any(not torch.equal(master[k], master[k].bfloat16().float()) for k in weights)  # not bf16-rounded


def test_a_save_at_once_flushes_every_file_deepspeed_writes_on_its_writer(tmp_path, monkeypatch):
    """Each rank flushes the files DeepSpeed's engine wrote for it before the save returns (on a shared file
    system only the writer's fsync flushes them; rank 0 flushes the tree before the publication, its own node's)."""
    flushed = []
    fsync = os.fsync

    def recorded(fd):
        flushed.append(os.path.realpath(f"/proc/self/fd/{fd}"))
        return fsync(fd)

    with one_rank_group(CPU):
        strategy = built_strategy(CPU, "parallel.strategy=zero2")
        try:
            strategy_step(strategy, CPU)
            monkeypatch.setattr(os, "fsync", recorded)
            strategy.save(tmp_path)
        finally:
            monkeypatch.undo()
            strategy.close()
    written = sorted(str(p.resolve()) for p in tmp_path.rglob("*.pt"))
    assert len(written) >= 2 and set(written) <= set(flushed), (written, flushed)
