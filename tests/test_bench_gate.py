"""`bench gate` (convit_scale/bench/gate.py): each bad-step gate candidate timed on a real ZeRO step."""

import pytest

from convit_scale.errors import BadInput


def test_gate_bench_times_each_candidate_on_a_real_zero_step():
    """`bench gate`'s measurement at test size, in this process (a one-rank group): the hooks it replaced, the fused
    norm, DeepSpeed's own check (ZeRO-1/2), beside a whole step of the real strategy."""
    from convit_scale.bench.gate import bench_gate
    from convit_scale.bench.gate import worker as gate_worker
    from convit_scale.models import create_model

    with pytest.raises(BadInput, match="--strategies ddp: allowed: zero1, zero2, zero3"):
        bench_gate("convit_nano", 16, 2, 1, ["ddp"], "cpu", "fp32")
    row = gate_worker({"model": "convit_nano", "img_size": 16, "batch": 2, "steps": 1, "strategy": "zero2",
                  "precision": "bf16", "device": "cpu", "repeat": 2})
    assert row["tensors"] == sum(1 for _ in create_model("convit_nano").parameters())
    assert all(row[k] > 0 for k in ("step_ms", "hooks_ms_per_micro_batch", "fused_ms_per_step",
                                    "deepspeed_check_ms_per_step"))
