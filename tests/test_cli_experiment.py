"""``convit-scale demo`` and ``convit-scale experiment`` (convit_scale/cli/experiment.py): what each hands to the run
it starts (the runs themselves: tests/test_experiments_*.py), and the flags refused before any run starts."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest
import torch

from convit_scale.cli import main
from convit_scale.cli.experiment import _seeds


def test_demo_passes_its_flags_and_runs_two_cpu_processes_without_a_gpu(monkeypatch):
    calls = []
    monkeypatch.setattr("convit_scale.experiments.demo.run_demo", lambda out, **kw: calls.append((out, kw)))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert main(["demo", "--out", "d", "--loader", "ffcv", "--epochs", "2", "optim.base_lr=1e-3"]) == 0
    out, kw = calls[-1]
    assert out == Path("d") and kw == dict(loader="ffcv", strategy="fsdp2", nproc=2, epochs=2, train_per_class=6000,
                                           val_per_class=200, extra=["optim.base_lr=1e-3"])
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # every GPU, unless --nproc says otherwise
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 4)
    assert main(["demo"]) == 0 and calls[-1][1]["nproc"] == 4 and calls[-1][0] == Path("runs/demo")
    assert main(["demo", "--nproc", "3", "--strategy", "zero2"]) == 0
    assert (calls[-1][1]["nproc"], calls[-1][1]["strategy"]) == (3, "zero2")


def test_experiment_passes_its_flags_and_prints_the_table(monkeypatch, capsys):
    calls = []

    def run(out, **kw):
        calls.append((out, kw))
        return {"markdown": "| the table |"}

    monkeypatch.setattr("convit_scale.experiments.sample_efficiency.run_sample_efficiency", run)
    assert main(["experiment", "sample-efficiency", "--fractions", "0.1,1", "--seeds", "2,0", "--jobs", "2",
                 "--models", "deit_micro"]) == 0
    out, kw = calls[-1]
    assert out == Path("runs/sample_efficiency")
    assert kw == dict(fractions=[0.1, 1.0], base_epochs=12, models=["deit_micro"], nproc=1, train_per_class=1000,
                      val_per_class=200, jobs=2, seeds=(2, 0))
    assert capsys.readouterr().out.strip() == "| the table |"
    assert main(["experiment", "sample-efficiency"]) == 0
    assert (calls[-1][1]["fractions"], calls[-1][1]["models"], calls[-1][1]["seeds"]) == \
        ([0.05, 0.1, 0.3, 0.5, 1.0], ["convit_micro", "deit_micro"], (0,))


def test_seeds_are_distinct_integers_at_least_zero():
    assert _seeds("0, 3,1") == [0, 3, 1]
    for text, words in (("1,1", "'1,1': a seed given twice"), ("0,-1", "-1 is not allowed: must be >= 0"),
                        ("0,,1", "an empty name"), ("x", "'x' is not an integer")):
        with pytest.raises(argparse.ArgumentTypeError, match=words.replace("(", r"\(")):
            _seeds(text)


@pytest.mark.parametrize("argv,words", [
    (["experiment", "sample-efficiency", "--seeds", "4,4"], ["--seeds", "a seed given twice"]),
    (["experiment", "table3"], ["invalid choice: 'table3'"]),
    (["demo", "--loader", "tfrecord"], ["--loader", "invalid choice: 'tfrecord'"]),
    (["demo", "--strategy", "none"], ["--strategy", "invalid choice: 'none'"]),
])
def test_bad_flags_are_refused_before_any_run(argv, words, monkeypatch, capsys):
    monkeypatch.setattr("convit_scale.experiments.demo.run_demo", lambda *a, **k: pytest.fail("a run started"))
    monkeypatch.setattr("convit_scale.experiments.sample_efficiency.run_sample_efficiency",
                        lambda *a, **k: pytest.fail("a run started"))
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: ") and len(err.splitlines()) == 1 and all(w in err for w in words), err
