"""A bad step (non-finite loss, non-finite gradient) never reaches the weights, under every strategy and whatever
DeepSpeed's own overflow checks do: the loop decides from the step's packed reduction before any update, and a
ZeRO step it refuses goes through DeepSpeed with the optimizer gated shut (convit_scale/parallel/zero_engine.py).

One rank in this process: the decision's logic is the same at any world size (the 2-rank runs of
tests/test_train_engine_faults.py check that every rank skips alike)."""

from __future__ import annotations

import math

import pytest
from support import records, tiny_recipe, train_here

NO_MIX = {"mixup": 0.0, "cutmix": 0.0}
EXACT = {"name": "convit_nano", "num_classes": 10, "drop_path_rate": 0.0}


@pytest.fixture
def deepspeed_checks_off(monkeypatch):
    """DeepSpeed's own non-finite checks switched off, as in the releases the version range once admitted (ZeRO-3
    checked overflow for fp16 only and reported an invalid norm as -1; ZeRO-1/2 did not check fp32): without the
    loop's own decision a non-finite gradient would become non-finite weights."""
    from deepspeed.runtime.zero import stage3, stage_1_and_2

    monkeypatch.setattr(stage_1_and_2, "is_invalid_grad_norm", lambda norm: False, raising=False)
    monkeypatch.setattr(stage3, "is_invalid_grad_norm", lambda norm: False, raising=False)
    monkeypatch.setattr(stage_1_and_2.DeepSpeedZeroOptimizer, "check_overflow", lambda self, *a, **k: None)


@pytest.mark.parametrize("strategy, precision", [("ddp", "fp32"), ("fsdp2", "fp32"), ("zero1", "fp32"),
                                                  ("zero2", "fp32"), ("zero2", "bf16"), ("zero3", "fp32")])
def test_a_bad_step_leaves_weights_and_moments_exactly(strategy, precision, fm_tree, tmp_path, deepspeed_checks_off):
    """Accumulation 2. Step index 1: the loss of its second micro-batch is NaN; step index 3: the loss stays finite
    but its gradient is infinite. Each is skipped and counted: the digest of weights and optimizer state after it
    equals the one before it, and the good steps around them do change the state. ZeRO-2 in bf16 too, where the
    strategy turns DeepSpeed's own bf16 overflow check off (the gate alone decides)."""
    r = tiny_recipe(tmp_path / "r.yaml", "imagefolder", fm_tree, tmp_path / "out", model=EXACT,
                    data={**NO_MIX, "micro_batch_size": 16, "val_path": ""},
                    parallel={"strategy": strategy, "precision": precision},
                    schedule={"max_steps": 5}, log={"debug_digest": True})
    rc = train_here(r, env={"CONVIT_SCALE_NAN_AT_STEP": "1:1", "CONVIT_SCALE_INF_GRAD_AT_STEP": "3"})
    assert rc == 0
    digests = {d["step"]: d["state_digest"][0] for d in records(tmp_path / "out", "digest")}
    assert sorted(digests) == [1, 2, 3, 4, 5]
    assert digests[2] == digests[1] and digests[4] == digests[3]  # the bad steps changed nothing
    assert len({digests[1], digests[3], digests[5]}) == 3  # the good ones did
    train = records(tmp_path / "out")
    assert [t["skipped_steps"] for t in train] == [0, 1, 1, 2, 2]
    assert [t["loss"] is None for t in train] == [False, True, False, True, False]
    assert all(math.isfinite(t["grad_norm"]) for i, t in enumerate(train) if i in (0, 2, 4))
