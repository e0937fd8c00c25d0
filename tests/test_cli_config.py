"""`convit-scale config` (convit_scale/cli/config.py): `--recipe` as every other command takes it, the recipe as the
first argument as before."""

from __future__ import annotations

import pytest
import yaml
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


def test_explain_prints_a_keys_documentation(capsys, monkeypatch):
    """The field docstrings of config.py are the recipe's reference: `config --explain KEY` prints them."""
    monkeypatch.chdir(REPO)
    assert main(["config", "--explain", "parallel.strategy"]) == 0
    assert capsys.readouterr().out == ("parallel.strategy: one of 'none', 'ddp', 'fsdp2', 'zero1', 'zero2', 'zero3', "
                                       "default 'fsdp2'\n  How ranks share the work: DDP, FSDP2 (fully_shard), or "
                                       "DeepSpeed ZeRO stage 1/2/3.\n")
    assert main(["config", "--recipe", "recipes/table1/convit_base_plus.yaml", "--explain", "optim.base_lr"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("optim.base_lr: float, default 0.0005 (this recipe: 0.0004)\n  Learning rate at a global")
    assert main(["config", "--explain", "optim"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == "optim: a section" and "  optim.weight_decay: AdamW weight decay" in lines[3]
    assert main(["config", "--explain", "optim.weight_decai"]) == 2
    assert "no key 'weight_decai' in optim (did you mean 'optim.weight_decay'?)" in capsys.readouterr().err


def test_check_data_refuses_a_recipe_without_data_naming_where_its_paths_came_from(capsys, monkeypatch):
    """slurm/launch.sh's data check before srun: preflight's, with where the paths came from and what the recipe's
    data.format reads (an ImageFolder recipe: the tree it needs)."""
    monkeypatch.chdir(REPO)
    unset = "DATA_DIR is not set (the recipe's data paths)"
    assert main(["config", "--recipe", "recipes/table1/convit_base_plus.yaml", "--world-size", "32", "--check-data",
                 unset]) == 2
    assert capsys.readouterr().err == (f"error: {unset}: data.train_path is empty: point it at prepared shards or "
                                       "an ImageFolder tree; expected ffcv data (data.format): a folder that "
                                       "`convit-scale prep ffcv` wrote (manifest.json), or .ffcv/.beton files\n")
    assert main(["config", "--recipe", DEMO, "--check-data", "DATA_DIR=/nonexistent", "data.format=imagefolder",
                 "data.train_path=/nonexistent"]) == 2
    assert capsys.readouterr().err.endswith("data.train_path: /nonexistent does not exist; expected imagefolder data "
                                            "(data.format): an ImageFolder root with train/ and val/ folders of class "
                                            "folders\n")


def test_world_size_check_is_the_ranks_own(capsys, monkeypatch):
    """slurm/launch.sh's check before srun is check_world, what every rank checks at set-up: a strategy that cannot
    run on that many ranks is refused before any starts, as more ranks than canonical groups are."""
    monkeypatch.chdir(REPO)
    assert main(["config", "--recipe", DEMO, "--world-size", "2", "parallel.strategy=none"]) == 2
    assert "parallel.strategy = 'none' on 2 ranks" in capsys.readouterr().err
    assert main(["config", "--recipe", "recipes/table1/convit_base_plus.yaml", "--world-size", "40"]) == 2
    assert "40 ranks exceed the 32 canonical groups" in capsys.readouterr().err
    # 3 of the 4 nodes: unequal shares, said in a YAML comment above the config (launch.sh's log)
    assert main(["config", "--recipe", "recipes/table1/convit_base_plus.yaml", "--world-size", "24"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("# 24 ranks hold 32 canonical groups unequally: 8 ranks x 2, 16 x 1; step time as for 16 "
                          "ranks x 2\n") and yaml.safe_load(out)["data"]["canonical_groups"] == 32
    assert main(["config", "--recipe", DEMO, "--world-size", "2", "--get", "data.global_batch_size"]) == 0
