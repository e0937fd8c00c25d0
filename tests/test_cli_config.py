"""`convit-scale config` (convit_scale/cli/config.py): `--recipe` as every other command takes it, the recipe as the
first argument as before."""

from __future__ import annotations

import pytest
from support import REPO

from convit_scale.cli import main

DEMO = "recipes/cpu/demo.yaml"


def test_recipe_flag_and_positional_recipe_print_the_same_config(capsys, monkeypatch):
    monkeypatch.chdir(REPO)
    assert main(["config", "--recipe", DEMO, "optim.base_lr=1e-3", "schedule.epochs=2"]) == 0
    with_flag = capsys.readouterr().out
    assert main(["config", DEMO, "optim.base_lr=1e-3", "schedule.epochs=2"]) == 0
    assert capsys.readouterr().out == with_flag
    assert "base_lr: 0.001" in with_flag and "epochs: 2" in with_flag


@pytest.mark.parametrize("argv,words", [
    (["config"], ["config needs --recipe"]),
    (["config", "optim.base_lr=1e-3"], ["config needs --recipe", "as --recipe R or as the first argument"]),
    (["config", "recipes/cpu/none.yaml"], ["argument --recipe", "recipe not found: recipes/cpu/none.yaml"]),
    (["config", "--recipe", "recipes/cpu/none.yaml"], ["argument --recipe", "recipe not found"]),
    (["config", "--recipe", DEMO, DEMO], [f"override '{DEMO}' is not of the form section.key=value"]),
])
def test_config_without_a_recipe_is_one_error_line(argv, words, capsys, monkeypatch):
    monkeypatch.chdir(REPO)
    assert main(argv) == 2
    out, err = capsys.readouterr()
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and not out, err
    for word in words:
        assert word in lines[0], lines[0]


def test_get_prints_one_key(capsys, monkeypatch):
    monkeypatch.chdir(REPO)
    assert main(["config", "--recipe", "recipes/table3/convit_small_plus_b_full.yaml", "--get", "run.output_dir"]) == 0
    assert capsys.readouterr().out == "runs/table3/b_full\n"
    assert main(["config", "--recipe", DEMO, "--get", "data.global_batch_size", "data.global_batch_size=64"]) == 0
    assert capsys.readouterr().out == "64\n"
    assert main(["config", "--recipe", DEMO, "--get", "run.nope"]) == 2
    assert "--get run.nope: no such key in the config" in capsys.readouterr().err
