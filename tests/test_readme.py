"""README.md's and docs/*.md's examples as written: every `convit-scale` command line of their shell blocks parses
(options, shipped recipes and overrides included), every flag an inline `convit-scale ...` names exists, the Slurm
lines name scripts and recipes that exist, every relative link resolves (to a file, and to a heading where it names
one), and the checkpoint the analysis example names is one a Table 1 run writes. Parsing only: nothing runs."""

from __future__ import annotations

import argparse
import re
import shlex

import pytest
from support import REPO

from convit_scale.cli import build_parser
from convit_scale.config import load_config

DOCS = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md")), REPO / "BENCHMARKS.md",
        *sorted((REPO / "slurm").rglob("*.md"))]
TEXT = {p.relative_to(REPO).as_posix(): p.read_text() for p in DOCS}
README = TEXT["README.md"]
ALL = "\n".join(TEXT.values())


def _shell_lines(text: str) -> list[str]:
    """The commands of the ```bash blocks: continuation lines joined, comments dropped."""
    lines = []
    for block in re.findall(r"```bash\n(.*?)```", text, re.S):
        for command in block.replace("\\\n", " ").splitlines():
            command = re.sub(r"\s+#.*$", "", command).strip()
            if command and not command.startswith("#"):
                lines.append(command)
    return lines


def _lines(pred) -> list:
    """(file, line) for every shell line of every page that pred accepts, each once."""
    seen, out = set(), []
    for name, text in TEXT.items():
        for line in _shell_lines(text):
            if pred(line) and line not in seen:
                seen.add(line)
                out.append(pytest.param(line, id=f"{name}: {line[:60]}"))
    return out


CLI_LINES = _lines(lambda line: line.startswith("convit-scale "))
SLURM_LINES = _lines(lambda line: re.search(r"\bsbatch\b", line) is not None)


def test_the_readme_has_examples():
    """The README's first screen: the Slurm quick start (prep, plan, the site hook, sbatch, eval) and the two local
    commands; the docs hold the rest."""
    first_screen = "\n".join(README.splitlines()[:30])
    readme_cli = [line for line in _shell_lines(first_screen) if line.startswith("convit-scale ")]
    assert {shlex.split(line)[1] for line in readme_cli} >= {"prep", "plan", "eval"}
    for needed in ("sbatch slurm/", "slurm/site.example.sh", "make demo", "make test", "slurm/container/Dockerfile"):
        assert needed in first_screen, needed
    assert len(README.splitlines()) <= 220
    every = [p.values[0] for p in CLI_LINES]
    assert len(every) >= 20 and len(SLURM_LINES) >= 8
    assert {shlex.split(line)[1] for line in every} >= {"prep", "train", "plan", "analyze", "eval"}


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


INLINE = sorted(set(re.findall(r"`(convit-scale [^`]+)`", ALL)))


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
    named = set(re.findall(r"(?<![\w/.])((?:slurm|recipes|tests|convit_scale|data_prep)/[\w./*-]*\w)", ALL))
    missing = [p for p in sorted(named) if not any(REPO.glob(p)) and p != "slurm/site.sh"]  # site.sh: the user's
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
    assert final == "step_000375300" and "step_000375000" not in ALL
    assert TEXT["docs/evaluation.md"].count(final) >= 3


def test_bench_data_says_it_needs_the_bench_extra():
    assert "`bench` extra, `pip install -e '.[bench]'`" in TEXT["docs/data.md"]
    assert 'bench = ["scikit-learn' in (REPO / "pyproject.toml").read_text()
    assert "pip install -e '.[bench]'" in (REPO / "convit_scale" / "bench" / "data.py").read_text()


def _slug(heading: str) -> str:
    """GitHub's anchor of a heading: lower case, punctuation but hyphens dropped, spaces to hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def _anchors(text: str) -> set[str]:
    text = re.sub(r"```.*?```", "", text, flags=re.S)
    return {_slug(h) for h in re.findall(r"(?m)^#{1,6} (.+)$", text)}


LINKS = [pytest.param(name, target, id=f"{name} -> {target}") for name, text in TEXT.items()
         for target in sorted(set(re.findall(r"\]\(([^)\s]+)\)", text))) if not re.match(r"[a-z]+:", target)]


@pytest.mark.parametrize("name,target", LINKS)
def test_each_relative_link_resolves(name, target):
    path, _, anchor = target.partition("#")
    page = (REPO / name).parent / path if path else REPO / name
    assert page.exists(), f"{name}: [{target}] names no file"
    if anchor:
        assert page.suffix == ".md" and anchor in _anchors(page.read_text()), f"{name}: no heading #{anchor} in {page}"


def test_the_docs_are_linked_from_the_readme():
    for page in sorted((REPO / "docs").glob("*.md")):
        assert f"](docs/{page.name})" in README, f"README.md does not link docs/{page.name}"
