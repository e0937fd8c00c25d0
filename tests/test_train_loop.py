"""The loop (convit_scale/train/loop.py), a run in this process: records at log steps (by step or by rank 0's clock)
and always at the end, periodic checkpoints and the end's, the evaluation of a run that max_steps ends mid-epoch,
and the end record."""

from __future__ import annotations

import pytest
from support import records, tiny_recipe, train_here


def test_logs_checkpoints_evaluation_and_end_of_a_run_ended_mid_epoch(fm_tree, tmp_path):
    out = tmp_path / "out"
    r = tiny_recipe(tmp_path / "r.yaml", "imagefolder", fm_tree, out, schedule={"max_steps": 5},
                    parallel={"strategy": "none"}, log={"every_steps": 2, "progress": False, "analysis_images": 0},
                    checkpoint={"every_steps": 2, "keep_last": 5})
    assert train_here(r) == 0
    assert [t["step"] for t in records(out)] == [2, 4, 5]  # every 2 steps, and the last
    saves = records(out, "checkpoint")
    assert [(c["step"], c["reason"]) for c in saves] == [(2, "every_steps"), (4, "every_steps"), (5, "end")]
    assert sorted(p.name for p in (out / "checkpoints").glob("step_*")) == [f"step_{s:09d}" for s in (2, 4, 5)]
    (ev,) = records(out, "eval")  # 31 steps an epoch: max_steps ended epoch 0 early, evaluated once at the end
    assert ev["epoch"] == 0 and ev["samples"] == 200
    (end,) = records(out, "end")
    assert end["step"] == 5 and end["checkpoint"].endswith("step_000000005") and end["top1"] == ev["top1"]


@pytest.mark.parametrize("every_seconds,logged", [(1e-9, [1, 2, 3, 4]), (1e9, [4])])
def test_log_records_by_time_on_rank_0s_clock(every_seconds, logged, fm_tree, tmp_path):
    """log.every_steps null, log.every_seconds: a record when rank 0's clock says so, agreed in the step's reduction
    (its log_due slot), and always one at the end."""
    from convit_scale.config import load_config

    r = tiny_recipe(tmp_path / "r.yaml", "imagefolder", fm_tree, tmp_path / "out", data={"val_path": ""},
                    schedule={"max_steps": 4}, log={"every_steps": None, "every_seconds": every_seconds,
                                                    "progress": False})
    assert train_here(r) == 0
    assert [t["step"] for t in records(tmp_path / "out")] == logged
    assert load_config("recipes/table1/convit_base_plus.yaml", []).log.every_seconds == 30  # the GPU recipes' rate
