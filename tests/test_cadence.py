"""The checkpoint interval (Young/Daly) and what one failure costs, against values worked by hand."""

import json
import math

import pytest

from convit_scale.cadence import advice, advice_line, failure_cost_s, job_mtbf_h, overhead, young_daly_s


def test_young_daly_interval_and_the_cost_of_a_failure():
    assert job_mtbf_h(1024) == pytest.approx(7.9) and job_mtbf_h(32) == pytest.approx(7.9 * 32)
    # 60 s saves, 7.9 h MTBF: sqrt(2 x 60 x 28,440) = 1,847.4 s, about 31 minutes
    assert young_daly_s(60, 7.9 * 3600) == pytest.approx(1847.4, abs=0.1)
    assert failure_cost_s(1800, restart_s=300) == 1200
    a = advice(60, 1024, restart_s=300)
    assert a["every_minutes"] == pytest.approx(1847.4 / 60, abs=0.01)
    assert a["failure_gpu_hours"] == pytest.approx((1847.4 / 2 + 300) * 1024 / 3600, rel=1e-4)
    # the interval minimises the overhead: a shorter or longer one loses more
    best = overhead(young_daly_s(60, 28440), 60, 28440)
    assert best < overhead(900, 60, 28440) and best < overhead(3600, 60, 28440)
    assert math.isclose(advice(60, 8, mtbf_h=2.0)["mtbf_h"], 2.0)


def test_the_plan_line_uses_the_run_s_measured_saves(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    (run / "metrics.jsonl").write_text("".join(json.dumps({"kind": "checkpoint", "step": s, "save_s": t}) + "\n"
                                               for s, t in ((10, 20.0), (20, 30.0), (30, 40.0))))
    line = advice_line(run, 1024, mtbf_h=7.9)
    assert "30.0 s per save, measured in" in line and "MTBF 7.90 h" in line
    assert f"checkpoint.every_minutes={math.sqrt(2 * 30 * 7.9 * 3600) / 60:.0f} " in line
    assert "60 s per save assumed" in advice_line(tmp_path / "none", 1024)


def test_the_job_time_counts_saves_evaluations_and_analyses_worked_by_hand():
    """300 epochs of 20 s of steps, an evaluation (2 s) and an analysis (1 s) after each: 6,900 s without saves."""
    from convit_scale.cadence import every_minutes_of, job_time

    each_epoch = job_time(6000, 300, 1, 174, 300, 2.0, 1.0, 60.0)  # an epoch (23 s) ends before 174 min pass
    assert (each_epoch["epoch_saves"], each_epoch["timed_saves"], each_epoch["saves"]) == (300, 0, 301)
    assert each_epoch["total_s"] == 6000 + 300 * 3 + 301 * 60
    assert each_epoch["share"]["saves"] == pytest.approx(301 * 60 / (6900 + 301 * 60))
    by_time = job_time(6000, 300, None, 10, 300, 2.0, 1.0, 60.0)  # 6,900 s: 11 saves by time, one at the end
    assert (by_time["epoch_saves"], by_time["timed_saves"], by_time["saves"]) == (0, 11, 12)
    assert by_time["share"]["evaluation"] == pytest.approx(600 / (6900 + 12 * 60))
    assert every_minutes_of(30.0, "unused", 8) == 30.0 and every_minutes_of(None, "unused", 8) is None
    assert every_minutes_of("auto", "none", 1024) == pytest.approx(1847.4 / 60, abs=0.01)  # 60 s assumed
