"""README.md's examples as written: every `convit-scale` command line of its shell blocks parses (options, shipped
recipes and overrides included), every flag an inline `convit-scale ...` names exists, the Slurm lines name scripts
and recipes that exist, and the checkpoint the analysis example names is one a Table 1 run writes."""

from __future__ import annotations

import argparse
import re
import shlex

import pytest
from support import REPO

from convit_scale.cli import build_parser
from convit_scale.config import load_config

README = (REPO / "README.md").read_text()


def _shell_lines() -> list[str]:
    """The commands of the ```bash blocks: continuation lines joined, comments dropped."""
    lines = []
    for block in re.findall(r"```bash\n(.*?)```", README, re.S):
        for command in block.replace("\\\n", " ").splitlines():
            command = re.sub(r"\s+#.*$", "", command).strip()
            if command and not command.startswith("#"):
                lines.append(command)
    return lines


CLI_LINES = [line for line in _shell_lines() if line.startswith("convit-scale ")]
SLURM_LINES = [line for line in _shell_lines() if re.search(r"\bsbatch\b", line)]


def test_the_readme_has_examples():
    assert len(CLI_LINES) >= 9 and len(SLURM_LINES) >= 6
    assert {shlex.split(line)[1] for line in CLI_LINES} >= {"prep", "train", "plan", "analyze", "eval"}


@pytest.mark.parametrize("line", CLI_LINES)
def test_each_convit_scale_line_parses(line, monkeypatch):
    monkeypatch.chdir(REPO)  # shipped recipes by their relative names
    try:
        args = build_parser().parse_args(shlex.split(line)[1:])
    except Exception as e:  # a UsageError: the one line the user would get
        pytest.fail(f"{line}\n-> {e}")
    if getattr(args, "recipe", None) and hasattr(args, "overrides"):
        load_config(args.recipe, list(args.overrides))  # the overrides' keys and values are the recipe's


def _parser_of(words: list[str]) -> tuple[argparse.ArgumentParser, list[str]]:
    """The (sub-)parser a command line reaches, and the words after its sub-command names."""
    parser, rest = build_parser(), list(words)
    while rest:
        subs = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
        if not subs or rest[0] not in subs[0].choices:
            break
        parser = subs[0].choices[rest.pop(0)]
    return parser, rest


INLINE = sorted(set(re.findall(r"`(convit-scale [^`]+)`", README)))


@pytest.mark.parametrize("text", INLINE)
def test_each_inline_command_names_real_options(text):
    words = text.replace("[", " ").replace("]", " ").split()[1:]
    parser, rest = _parser_of(words)
    known = {o for a in parser._actions if a.help != argparse.SUPPRESS for o in a.option_strings}
    for word in rest:
        flag = word.split("=")[0]
        if flag.startswith("--") and not flag.startswith("--optim.") and "." not in flag:
            assert flag in known, f"`{text}`: {parser.prog} has no {flag}"
    if words and words[0] not in ("--version", "--help"):
        assert parser.prog != "convit-scale", f"`{text}`: no such command"


@pytest.mark.parametrize("line", SLURM_LINES)
def test_each_slurm_line_names_a_script_and_recipe_that_exist(line):
    words = shlex.split(line.replace("$((", "").replace("))", ""))
    scripts = [w.rstrip(")") for w in words if w.startswith("slurm/")]  # job=$(... sbatch --parsable slurm/x.sh)
    assert len(scripts) == 1 and (REPO / scripts[0]).is_file(), line
    for word in words:
        if word.startswith("RECIPE="):
            load_config(str(REPO / word.split("=", 1)[1]), [])
        if word.startswith("FORMAT="):
            assert word.split("=", 1)[1] in ("ffcv", "wds"), line


def test_every_file_the_readme_names_exists():
    named = set(re.findall(r"\b((?:slurm|recipes|tests|convit_scale|data_prep)/[\w./-]*\w)", README))
    missing = [p for p in sorted(named) if not (REPO / p).exists() and p != "slurm/site.sh"]  # site.sh: the user's
    assert not missing, missing


def test_the_analysis_example_names_a_checkpoint_a_table1_run_writes():
    """step_000375300: 1,281,167 ImageNet images at global batch 1024 are 1,251 steps per epoch on any layout of
    the batch (world x micro x accumulation), 300 epochs end there (before: step_000375000, which no run writes)."""
    from convit_scale.data.geometry import EpochGeometry, LoaderSpec

    cfg = load_config(str(REPO / "recipes" / "table1" / "convit_small.yaml"), [])
    assert cfg.data.global_batch_size == 1024 and cfg.schedule.epochs == 300
    for world, micro in ((8, 128), (16, 32), (32, 32), (64, 16)):
        accum = 1024 // (world * micro)
        batches = EpochGeometry.of(1_281_167, LoaderSpec("train", 224, micro, world), "imagenet").num_batches
        assert batches // accum == 1251, (world, micro)
    final = f"step_{300 * 1251:09d}"
    assert final == "step_000375300" and "step_000375000" not in README
    assert README.count(final) >= 3


def test_bench_data_says_it_needs_the_bench_extra():
    assert "`bench` extra, `pip install -e '.[bench]'`" in README
    assert 'bench = ["scikit-learn' in (REPO / "pyproject.toml").read_text()
    assert "pip install -e '.[bench]'" in (REPO / "convit_scale" / "bench" / "data.py").read_text()
