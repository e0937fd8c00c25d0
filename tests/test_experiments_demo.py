"""`make demo`'s pipeline at a smaller size: shards, 2-process FSDP2 training, eval, plots; rerun is idempotent."""

import json

import pytest
from support import records, run_cli


@pytest.mark.slow
def test_demo_pipeline_small(tmp_path):
    out = tmp_path / "demo"
    args = ("demo", "--out", str(out), "--epochs", "2", "--train-per-class", "60", "--val-per-class", "10")
    res = run_cli(*args)
    assert res.returncode == 0, res.stderr[-3000:]
    for fmt in ("wds", "ffcv"):
        assert json.loads((out / "data" / fmt / "manifest.json").read_text())["splits"]["train"]["num_samples"] == 600
    assert "2 rank(s) on cpu" in res.stdout and "strategy fsdp2" in res.stdout
    evals = records(out / "train", "eval")
    assert evals and evals[-1]["samples"] == 100
    for png in ("gating", "nonlocality", "attention_maps", "attention_distance", "cka_self", "gating_history",
                "nonlocality_history", "training_curves"):
        assert (out / "analysis" / f"{png}.png").stat().st_size > 1000, png
    assert "convit-scale demo" in res.stdout and "top-1 / top-5" in res.stdout
    # the analysis sees the validation images as the run's evaluation did (the recipe's whole-image view)
    analysis = json.loads((out / "analysis" / "analysis.json").read_text())
    assert analysis["images"] == 100 and analysis["masking_top1"]["none"] == pytest.approx(evals[-1]["top1"], abs=1e-6)
    output = res.stdout + res.stderr  # no foreign progress bars (FFCV's writer draws tqdm's) and no warnings
    assert "it/s]" not in output and "Warning" not in output, output[-3000:]
    shards = {p: p.stat().st_mtime_ns for p in (out / "data" / "wds").glob("*.tar")}
    # a second run redoes nothing: conversions are skipped and the finished training is not rerun
    again = run_cli(*args)
    assert again.returncode == 0, again.stderr[-3000:]
    assert "already trained" in again.stdout
    assert {p: p.stat().st_mtime_ns for p in (out / "data" / "wds").glob("*.tar")} == shards
    assert len(records(out / "train", "end")) == 1


def test_demo_refuses_a_bad_option(tmp_path):
    res = run_cli("demo", "--out", str(tmp_path / "d"), "--train-per-class", "20", "--val-per-class", "4",
                  "parallel.precision=fp64")
    assert res.returncode == 2 and "parallel.precision = 'fp64' is not allowed" in res.stderr
