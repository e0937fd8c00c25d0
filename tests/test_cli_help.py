"""The command line's conventions (convit_scale/cli/__init__.py): `--help` of every command without importing
torch, every option with help and its default shown, `--version`, and a hint for an override written as a flag."""

from __future__ import annotations

import argparse
import json
import subprocess
import sys

import pytest
from support import REPO

from convit_scale import __version__
from convit_scale.cli import build_parser, main

HEAVY = ("torch", "timm", "numpy", "deepspeed", "ffcv", "numba", "webdataset", "matplotlib", "cv2", "PIL")
"""Modules whose import costs seconds (torch alone 4-9 s here): none may load to answer --help."""


def _commands(parser: argparse.ArgumentParser, path=()):
    """Every command line that reaches a parser: (), ("prep",), ("prep", "ffcv"), ..."""
    yield path
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                yield from _commands(sub, (*path, name))


def _parsers(parser: argparse.ArgumentParser, path=()):
    yield path, parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                yield from _parsers(sub, (*path, name))


HELP_ALL = """
import contextlib, io, json, sys
from convit_scale.cli import build_parser
helps = {}
for argv in json.loads(sys.argv[1]):
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        try:
            build_parser().parse_args(argv + ["--help"])
        except SystemExit as e:
            assert e.code == 0, (argv, e.code)
    helps[" ".join(argv)] = out.getvalue()
print(json.dumps({"helps": helps, "loaded": sorted(m for m in json.loads(sys.argv[2]) if m in sys.modules)}))
"""


def test_help_of_every_command_imports_no_torch():
    """--help of each of the commands answers without importing torch, timm or any data library: what made it
    take 5-7 s. Checked in a fresh interpreter by what it loaded, not by a timing."""
    commands = [list(c) for c in _commands(build_parser())]
    assert ["prep", "ffcv"] in commands and ["bench"] in commands and len(commands) >= 15
    res = subprocess.run([sys.executable, "-c", HELP_ALL, json.dumps(commands), json.dumps(HEAVY)],
                         capture_output=True, text=True, cwd=REPO, timeout=120)
    assert res.returncode == 0, res.stderr[-3000:]
    result = json.loads(res.stdout)
    assert result["loaded"] == [], f"--help imported {result['loaded']}"
    assert set(result["helps"]) == {" ".join(c) for c in commands}
    assert all(text.startswith("usage: convit-scale") for text in result["helps"].values())


def test_every_option_has_help_and_shows_its_default():
    for path, parser in _parsers(build_parser()):
        text = parser.format_help()
        for action in parser._actions:
            if isinstance(action, (argparse._HelpAction, argparse._VersionAction, argparse._SubParsersAction)) \
                    or action.help == argparse.SUPPRESS:
                continue
            name = " ".join(path) + " " + (action.option_strings or [action.dest])[0]
            assert action.help, f"{name}: no help"
            default = action.default
            if default is not None and default != [] and not isinstance(default, bool):  # 0 too (0 == False)
                shown = ",".join(map(str, default)) if isinstance(default, list) else str(default)
                assert f"(default: {shown})" in " ".join(text.split()) or "default" in action.help, \
                    f"{name}: default {default!r} not shown"


def test_defaults_named_in_the_issue_are_shown():
    helps = {" ".join(p): " ".join(q.format_help().split()) for p, q in _parsers(build_parser())}
    assert "(default: h100-80gb)" in helps["plan"]
    assert "default: read from --data" in helps["eval"] and "default: read from --data" in helps["analyze"]
    assert "(default: 64)" in helps["eval"] and "(default: runs/bench)" in helps["bench"]
    assert "shuffle seed before sharding (default: 0)" in helps["prep wds"]  # hidden while 0 == False decided


def test_version(capsys):
    with pytest.raises(SystemExit) as e:
        main(["--version"])
    assert e.value.code == 0 and capsys.readouterr().out == f"convit-scale {__version__}\n"


@pytest.mark.parametrize("argv,hint", [
    (["plan", "--recipe", "recipes/cpu/demo.yaml", "--optim.base_lr=1e-3"], "optim.base_lr=1e-3"),
    (["config", "--recipe", "recipes/cpu/demo.yaml", "--data.num_workers", "4"], "data.num_workers=VALUE"),
    (["train", "--recipe", "recipes/cpu/demo.yaml", "-schedule.epochs=3"], "schedule.epochs=3"),
])
def test_an_override_written_as_a_flag_gets_a_hint(argv, hint, capsys, monkeypatch):
    monkeypatch.chdir(REPO)
    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "unrecognized arguments" in err[0], err
    assert err[0].endswith(f"overrides are written without dashes: {hint}"), err[0]


def test_a_flag_that_is_no_override_gets_no_hint(capsys, monkeypatch):
    monkeypatch.chdir(REPO)
    assert main(["plan", "--recipe", "recipes/cpu/demo.yaml", "--gpu-count", "8"]) == 2
    err = capsys.readouterr().err
    assert "unrecognized arguments: --gpu-count" in err and "overrides" not in err
