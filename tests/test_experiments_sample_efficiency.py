"""The CPU Table 2: every seed's runs, the images each run trained on, and each gap with its noise."""

import json
import math
from pathlib import Path

import pytest
from support import records, run_cli

from convit_scale.experiments import sample_efficiency as se


def test_summary_states_each_gap_with_its_noise(monkeypatch):
    steps = {"0.05": 720, "1": 1128}  # 240 epochs x 3 full batches of 128 (500 images), 12 x 94 (12,000 images)
    monkeypatch.setattr(se, "_ends", lambda run: [{"step": steps[run.name.split("_f")[1].split("_")[0]]}])
    runs, results = [], []
    for f, tops in ((0.05, {0: (77.0, 73.0), 1: (78.0, 75.0)}), (1.0, {0: (81.0, 81.5), 1: (80.0, 81.5)})):
        for seed, (convit, deit) in tops.items():
            for model, top1 in (("convit_micro", convit), ("deit_micro", deit)):
                runs.append((model, f, seed, Path(f"{model}_f{f:g}" + (f"_s{seed}" if seed else "")), []))
                results.append(top1)
    out = se._summary(runs, results, [0.05, 1.0], {0.05: 240, 1.0: 12}, ["convit_micro", "deit_micro"], 128, 2000)
    assert out["images_trained_on"] == {"0.05": 92_160, "1": 144_384}  # not 120,000 at f = 0.05: drop_last
    assert out["table"]["convit_micro"]["0.05"] == 77.5 and out["per_seed"]["deit_micro"]["0.05"] == [73.0, 75.0]
    g = out["gaps"]["0.05"]
    assert g["gap"] == pytest.approx(3.5) and g["per_seed"] == [4.0, 3.0]
    p, q = 0.775, 0.74
    assert g["sampling_se"] == pytest.approx(100 * math.hypot(math.sqrt(p * (1 - p) / 2000),
                                                               math.sqrt(q * (1 - q) / 2000)))
    assert "| 0.05 | 240 | 92,160 | 77.50 | 74.00 | +3.50 |" in out["markdown"]


def test_sample_efficiency_experiment_small(tmp_path):
    """Table 2 at test size, two runs at a time: every (model, f) trains base/f epochs on its subset, and a
    second call trains nothing again."""
    out = tmp_path / "se"
    args = ("experiment", "sample-efficiency", "--out", str(out), "--fractions", "0.5,1", "--base-epochs", "2",
            "--train-per-class", "26", "--val-per-class", "4", "--jobs", "2")
    res = run_cli(*args)
    assert res.returncode == 0, res.stderr[-3000:]
    table = json.loads((out / "sample_efficiency.json").read_text())["table"]
    assert set(table) == {"convit_micro", "deit_micro"} and all(set(t) == {"0.5", "1"} for t in table.values())
    for model in table:
        for f, epochs, steps in (("0.5", 4, 4), ("1", 2, 4)):  # 130 and 260 images, batches of 128
            evals = records(out / f"{model}_f{f}", "eval")
            assert [e["epoch"] for e in evals] == list(range(epochs)) and evals[-1]["samples"] == 40
            assert evals[-1]["top1"] == table[model][f]
            assert records(out / f"{model}_f{f}", "end")[-1]["step"] == steps
    assert (out / "sample_efficiency.png").stat().st_size > 1000
    again = run_cli(*args)
    assert again.returncode == 0 and all(len(records(out / f"{m}_f{f}", "end")) == 1
                                         for m in table for f in ("0.5", "1"))


def test_one_run_at_a_time_trains_in_this_thread(tmp_path):
    """``--jobs 1`` (the default) trains each run in this process, whose stop signals only the main thread can
    take: the runs go one after another there, not in a pool thread."""
    result = se.run_sample_efficiency(tmp_path / "se", [1.0], 2, ["convit_micro"], train_per_class=26,
                                      val_per_class=4, jobs=1)
    evals = records(tmp_path / "se" / "convit_micro_f1", "eval")
    assert [e["epoch"] for e in evals] == [0, 1] and result["table"]["convit_micro"]["1"] == evals[-1]["top1"]
