"""`bench universal` (convit_scale/bench/universal.py): a ZeRO checkpoint converted, sized and timed."""

import pytest

from convit_scale.errors import BadInput


def test_universal_bench_converts_a_zero_checkpoint_and_refuses_other_strategies(tmp_path):
    """`bench universal` at test size: a one-step ZeRO-2 run on 1 rank (in this process), its checkpoint converted,
    sized and timed; the other ranks' wait is the process group's timeout plus the checkpoint at 5 MB/s plus its files
    at 20 ms each."""
    from convit_scale.bench.universal import bench_universal

    with pytest.raises(BadInput, match="--strategies fsdp2: allowed: zero1, zero2, zero3"):
        bench_universal(tmp_path, "convit_nano", 28, [1], ["zero2", "fsdp2"])
    (row,) = bench_universal(tmp_path, "convit_nano", 28, [1], ["zero2"])["rows"]
    assert row["zero_bytes"] > 0 and row["universal_bytes"] > 0 and row["seconds"] > 0, row
    assert 0 < row["universal_files"] <= row["files_bound"], row
    assert row["others_wait_up_to_s"] == pytest.approx(600 + row["zero_bytes"] / 5e6 + row["files_bound"] * 0.02)
    assert not (tmp_path / "zero2_1" / "checkpoints").exists()
