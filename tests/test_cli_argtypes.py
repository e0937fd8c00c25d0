"""The command line's ``type=`` helpers (convit_scale/cli/argtypes.py): each accepts its range, and refuses the rest
with a message naming the value and what is allowed (argparse adds the flag: tests/test_cli.py)."""

from __future__ import annotations

import argparse

import pytest
import torch

from convit_scale.cli import argtypes


def refused(check, text: str, *words: str) -> str:
    with pytest.raises(argparse.ArgumentTypeError) as e:
        check(text)
    for word in words:
        assert word in str(e.value), str(e.value)
    return str(e.value)


def test_integers_at_least_and_between():
    assert argtypes.positive_int("1") == 1 and argtypes.non_negative_int("0") == 0
    assert argtypes.int_at_least(3)("7") == 7 and argtypes.int_at_least(3).__name__ == "int_at_least_3"
    refused(argtypes.positive_int, "0", "0 is not allowed: must be >= 1")
    refused(argtypes.non_negative_int, "-1", "-1 is not allowed: must be >= 0")
    refused(argtypes.positive_int, "2.5", "'2.5' is not an integer")
    between = argtypes.int_between(1, 100)
    assert [between(t) for t in ("1", "100")] == [1, 100] and between.__name__ == "int_between_1_100"
    for text in ("0", "101"):
        refused(between, text, f"{text} is not allowed: must be in 1..100")
    refused(between, "x", "'x' is not an integer")


def test_numbers_and_fractions():
    assert argtypes.positive_float("1e-3") == 1e-3
    for text in ("0", "-1", "inf", "nan"):
        refused(argtypes.positive_float, text, f"{text} is not allowed: must be > 0")
    refused(argtypes.positive_float, "fast", "'fast' is not a number")
    assert argtypes.fraction("1") == 1.0 and argtypes.fraction("0.05") == 0.05
    for text in ("0", "1.5", "nan"):
        refused(argtypes.fraction, text, "must be in (0, 1]")
    assert argtypes.fractions("0.1, 0.3,1") == [0.1, 0.3, 1.0]
    refused(argtypes.fractions, "0.1,0", "0 is not allowed: must be in (0, 1]")


def test_names_are_a_list_without_empty_ones():
    assert argtypes.names("convit_micro, deit_micro") == ["convit_micro", "deit_micro"]
    for text in ("a,,b", "a,", ""):
        refused(argtypes.names, text, "an empty name in the comma-separated list")


def test_resume_is_auto_none_or_a_complete_checkpoint(tmp_path):
    assert argtypes.resume("auto") == "auto" and argtypes.resume("none") == "none"
    refused(argtypes.resume, str(tmp_path), "auto, none, or a complete checkpoint folder (with meta.json)")
    (tmp_path / "meta.json").write_text("{}")
    assert argtypes.resume(str(tmp_path)) == str(tmp_path)


def test_recipe_is_a_file_or_a_shipped_name(tmp_path, monkeypatch):
    from convit_scale.config import recipe_path

    monkeypatch.chdir(tmp_path)  # not the repository: the shipped recipe by its name
    assert argtypes.recipe("recipes/cpu/demo.yaml") == str(recipe_path("recipes/cpu/demo.yaml"))
    (tmp_path / "mine.yaml").write_text("model: {name: convit_nano}\n")
    assert argtypes.recipe("mine.yaml") == "mine.yaml"
    refused(argtypes.recipe, "nope.yaml", "recipe not found: nope.yaml")


def test_device_names_a_visible_gpu_or_auto_or_cpu(monkeypatch):
    assert argtypes.device("auto") == "auto" and argtypes.device("cpu") == "cpu"
    for text in ("gpu", "cuda:x", "CPU", "cuda:"):
        refused(argtypes.device, text, f"{text!r} is not allowed; allowed: auto, cpu, cuda, cuda:N")
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    assert argtypes.device("cuda") == "cuda" and argtypes.device("cuda:1") == "cuda:1"
    refused(argtypes.device, "cuda:2", "'cuda:2': this machine has 2 visible GPU(s)")
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 0)
    refused(argtypes.device, "cuda", "'cuda': this machine has 0 visible GPU(s)")
