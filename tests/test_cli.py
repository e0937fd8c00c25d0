"""The command line: bad input is one `error:` line naming the flag and what is allowed, exit status 2, no
traceback, before any work starts; shipped recipes by name. Each command's own tests: tests/test_cli_<command>.py."""

import pytest
from support import REPO

from convit_scale.cli import main
from convit_scale.config import ConfigError, find_recipe, recipe_path

DEMO = "recipes/cpu/demo.yaml"
PREP = ["prep", "wds", "--src", "SRC", "--out", "OUT"]
PREP_FFCV = ["prep", "ffcv", "--src", "SRC", "--out", "OUT"]  # the options of `prep ffcv` only
EVAL = ["eval", "--checkpoint", "CKPT", "--data", "DATA"]
PLAN = ["plan", "--recipe", DEMO]
TRAIN = ["train", "--recipe", DEMO]

BAD_INPUT = [  # (argv, the flag the error names, what it says is allowed)
    (PREP + ["--subset-fraction", "0"], "--subset-fraction", "(0, 1]"),
    (PREP + ["--subset-fraction", "1.5"], "--subset-fraction", "(0, 1]"),
    (PREP + ["--subset-fraction", "half"], "--subset-fraction", "not a number"),
    (PREP_FFCV + ["--jpeg-quality", "0"], "--jpeg-quality", "1..100"),
    (PREP_FFCV + ["--jpeg-quality", "101"], "--jpeg-quality", "1..100"),
    (PREP + ["--shard-size", "0"], "--shard-size", ">= 1"),
    (PREP + ["--workers", "0"], "--workers", ">= 1"),
    (PREP_FFCV + ["--max-resolution", "-5"], "--max-resolution", ">= 1"),
    (["prep", "fashion-mnist", "--out", "OUT", "--train-per-class", "0"], "--train-per-class", ">= 1"),
    (["prep", "fashion-mnist", "--out", "OUT", "--val-per-class", "-1"], "--val-per-class", ">= 1"),
    (["prep", "wds", "--out", "OUT"], "--src", "needs --src"),
    (EVAL + ["--batch-size", "0"], "--batch-size", ">= 1"),
    (EVAL + ["--workers", "-1"], "--workers", ">= 0"),
    (EVAL + ["--img-size", "0"], "--img-size", ">= 1"),
    (EVAL + ["--num-classes", "0"], "--num-classes", ">= 1"),
    (EVAL + ["--batch-size", "2.5"], "--batch-size", "not an integer"),
    (PLAN + ["--nodes", "0"], "--nodes", ">= 1"),
    (PLAN + ["--gpus-per-node", "-8"], "--gpus-per-node", ">= 1"),
    (PLAN + ["--mfu", "0"], "--mfu", "(0, 1]"),
    (PLAN + ["--mfu", "1.2"], "--mfu", "(0, 1]"),
    (["plan", "--recipe", "recipes/cpu/nope.yaml"], "--recipe", "recipe not found"),
    (TRAIN + ["--nproc-per-node", "0"], "--nproc-per-node", ">= 1"),
    (TRAIN + ["--nproc-per-node", "-2"], "--nproc-per-node", ">= 1"),
    (TRAIN + ["--resume", "runs/nowhere/checkpoints/step_1"], "--resume", "auto, none, or a complete checkpoint"),
    (TRAIN + ["--resume", ""], "--resume", "auto, none, or a complete checkpoint"),
    (["demo", "--nproc", "0"], "--nproc", ">= 1"),
    (["experiment", "sample-efficiency", "--fractions", "0.1,0"], "--fractions", "(0, 1]"),
    (["experiment", "sample-efficiency", "--base-epochs", "0"], "--base-epochs", "> 0"),
    (["experiment", "sample-efficiency", "--models", "convit_micro,resnet9"], "--models", "unknown model(s) resnet9"),
]


@pytest.mark.parametrize("argv,flag,allowed", BAD_INPUT, ids=lambda v: " ".join(v) if isinstance(v, list) else None)
def test_bad_input_is_one_error_line(argv, flag, allowed, capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(REPO)  # shipped recipes by their relative name; nothing may be written here
    argv = [str(tmp_path / a) if a in ("SRC", "OUT", "CKPT", "DATA") else a for a in argv]
    assert main(argv) == 2
    out, err = capsys.readouterr()
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), err
    assert flag in lines[0] and allowed in lines[0], lines[0]
    assert "Traceback" not in err and not out
    assert not list(tmp_path.iterdir())  # refused before any work started


@pytest.mark.parametrize("argv,message", [
    (["config", DEMO, "optim.base_lr"], "override 'optim.base_lr' is not of the form section.key=value"),  # ConfigError
    (["config", DEMO, "optim.nope=1"], "unknown key 'optim.nope'"),
    (["config", DEMO, "optim.weight_decai=0.1"], "unknown key 'optim.weight_decai' (did you mean "
                                                 "'optim.weight_decay'?); allowed keys in 'optim': base_lr"),
    (["config", DEMO, "optimm.base_lr=1"], "unknown key 'optimm' (did you mean 'optim'?)"),
    (["config", "recipes/table1/convit_tinyy.yaml"], "recipe not found: recipes/table1/convit_tinyy.yaml (neither "
                                                     "a file nor a shipped recipe under"),
    (["config", "table1/convit_tny.yaml"], "; did you mean recipes/table1/convit_tiny.yaml?"),
    ([], "convit-scale: the following arguments are required: command; allowed: config, models, prep, train, eval"),
    (["bench"], "required: what; allowed: model, data, memory, distill, mfu, inference, pixels, universal, gate"),
    (["export", "--checkpoint", "CKPT", "--out", "OUT"], "CKPT"),
])
def test_expected_failures_of_a_command_are_one_line(argv, message, capsys, tmp_path, monkeypatch):
    """Raised by the command itself, after parsing: the same single line through main's one handler."""
    monkeypatch.chdir(REPO)
    argv = [str(tmp_path / a) if a in ("OUT", "CKPT") else a for a in argv]
    assert main(argv) == 2
    err = capsys.readouterr().err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and "Traceback" not in err, err
    assert message.replace("CKPT", str(tmp_path / "CKPT")) in lines[0], lines[0]


def test_shipped_recipes_by_name(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # not the repository: recipes/cpu/demo.yaml is no file here
    assert recipe_path("cpu/demo.yaml") == recipe_path("recipes/cpu/demo.yaml") == REPO / DEMO
    assert find_recipe(DEMO) == REPO / DEMO
    (tmp_path / "recipes" / "cpu").mkdir(parents=True)
    (tmp_path / DEMO).write_text("model: {name: convit_nano}\n")
    assert find_recipe(DEMO).resolve() == (tmp_path / DEMO).resolve()  # a file that exists comes first
    with pytest.raises(ConfigError, match="recipe not found: cpu/none.yaml"):
        recipe_path("cpu/none.yaml")
