"""``convit-scale train`` (convit_scale/cli/train.py): the recipe loaded with its overrides and ``--resume`` before any
process starts, then handed to ``launch.run_recipe`` (its tests: tests/test_train_launch.py); the refusals of bad
input: tests/test_cli.py, tests/test_bad_input.py."""

from __future__ import annotations

import pytest
from support import REPO, run_cli, tiny_recipe, train_here

from convit_scale.cli import main
from convit_scale.config import load_config

DEMO = "recipes/cpu/demo.yaml"


@pytest.fixture
def launched(monkeypatch):
    calls = []
    monkeypatch.setattr("convit_scale.train.launch.run_recipe",
                        lambda cfg, nproc, in_process: calls.append((cfg, nproc, in_process)) or 75)
    return calls


def test_the_recipe_and_its_overrides_reach_run_recipe(launched, monkeypatch):
    monkeypatch.chdir(REPO)
    assert main(["train", "--recipe", DEMO, "optim.base_lr=2e-3", "schedule.epochs=1"]) == 75  # its exit status
    cfg, nproc, in_process = launched[-1]
    assert (cfg.optim.base_lr, cfg.schedule.epochs, nproc, in_process) == (2e-3, 1, 1, True)
    assert main(["train", "--recipe", "cpu/demo.yaml", "--nproc-per-node", "3"]) == 75  # a shipped recipe by name
    assert launched[-1][1] == 3 and launched[-1][0].to_dict() == load_config(DEMO).to_dict()


def test_the_resume_flag_wins_over_the_override(launched, tmp_path, monkeypatch):
    monkeypatch.chdir(REPO)
    (tmp_path / "meta.json").write_text("{}")
    assert main(["train", "--recipe", DEMO, "--resume", "none", "checkpoint.resume=auto"]) == 75
    assert launched[-1][0].checkpoint.resume == "none"
    assert main(["train", "--recipe", DEMO, "checkpoint.resume=none", "--resume", str(tmp_path)]) == 75
    assert launched[-1][0].checkpoint.resume == str(tmp_path)
    assert main(["train", "--recipe", DEMO, "checkpoint.resume=none"]) == 75
    assert launched[-1][0].checkpoint.resume == "none"


def test_a_bad_override_is_refused_before_run_recipe(launched, monkeypatch, capsys):
    monkeypatch.chdir(REPO)
    assert main(["train", "--recipe", DEMO, "optim.nope=1"]) == 2
    assert "unknown key 'optim.nope'" in capsys.readouterr().err and not launched


@pytest.mark.slow
def test_resume_flag_is_the_checkpoint_resume_override(fm_tree, tmp_path):
    r = tiny_recipe(tmp_path / "r.yaml", "imagefolder", fm_tree, tmp_path / "out", parallel={"strategy": "none"},
                    schedule={"max_steps": 2}, checkpoint={"every_steps": 1}, data={"val_path": ""})
    assert train_here(r) == 0  # the checkpoint to name; the flag is the command's (below)
    step1 = tmp_path / "out" / "checkpoints" / "step_000000001"
    # the flag wins over an override of the same key, and names a checkpoint that is not the newest (of another
    # run: a run's own folder only goes forward, tests/test_train_checkpoint.py)
    res = run_cli("train", "--recipe", str(r), "--resume", str(step1), "checkpoint.resume=none",
                  "schedule.max_steps=3", f"run.output_dir={tmp_path / 'second'}")
    assert res.returncode == 0, res.stderr[-3000:]
    assert f"resumed from {step1} at step 1" in res.stdout
