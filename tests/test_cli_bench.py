"""``convit-scale bench`` (convit_scale/cli/bench.py): its benchmarks are the modules of convit_scale/bench/, and the
command hands the parsed flags, with their defaults, to ``bench.run_bench``."""

from __future__ import annotations

import argparse

import pytest
from support import REPO

from convit_scale.cli import build_parser, main
from convit_scale.cli.bench import KINDS


def _subcommand_help(name: str) -> str:
    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    return next(a.help for a in sub._choices_actions if a.dest == name)


def test_every_benchmark_is_a_module_of_the_bench_package_and_named_in_the_help():
    modules = {p.stem for p in (REPO / "convit_scale" / "bench").glob("*.py")}
    assert set(KINDS) <= modules, set(KINDS) - modules
    assert _subcommand_help("bench").endswith("(" + ", ".join(KINDS) + ")")


def test_the_flags_reach_run_bench_with_their_defaults(monkeypatch):
    seen = []
    monkeypatch.setattr("convit_scale.bench.run_bench", lambda args: seen.append(args) or 7)
    assert main(["bench", "model"]) == 7
    a = seen[-1]
    assert (a.what, a.out, a.device, a.precision, a.batch, a.steps, a.rounds, a.seconds) == \
        ("model", "runs/bench", "auto", "auto", None, 3, 2, 8.0)
    assert (a.decode_only, a.compile, a.warmup, a.boxes, a.model) == (False, False, 3, 200, "convit_base_plus")
    assert main(["bench", "data", "--batch", "16", "--decode-only", "--seconds", "0.5", "--rounds", "3"]) == 7
    a = seen[-1]
    assert (a.what, a.batch, a.decode_only, a.seconds, a.rounds) == ("data", 16, True, 0.5, 3)
    assert main(["bench", "mfu", "--batch-size", "8", "--peak-tflops", "989", "--compile"]) == 7
    assert (seen[-1].batch, seen[-1].peak_tflops, seen[-1].compile) == (8, 989.0, True)


@pytest.mark.parametrize("argv,words", [
    (["bench", "train"], ["argument what: invalid choice: 'train'"]),
    (["bench", "model", "--precision", "fp16"], ["--precision", "invalid choice: 'fp16'"]),
    (["bench", "data", "--seconds", "0"], ["--seconds", "must be > 0"]),
    (["bench", "mfu", "--warmup", "-1"], ["--warmup", "must be >= 0"]),
])
def test_bad_flags_are_refused_before_any_benchmark_runs(argv, words, monkeypatch, capsys):
    monkeypatch.setattr("convit_scale.bench.run_bench", lambda args: pytest.fail("a benchmark ran"))
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: ") and len(err.splitlines()) == 1
    assert all(w in err for w in words), err
