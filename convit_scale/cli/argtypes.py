"""``type=`` helpers for argparse: numbers refused with the allowed range before any work starts.

argparse reports a refused value as ``argument --flag: <message>``, so each message names the value and
what is allowed, and the flag comes from argparse.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from ..runfolder import META


def _number(kind: type, text: str):
    try:
        return kind(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not {'an integer' if kind is int else 'a number'}") from None


def int_at_least(low: int):
    """An integer >= ``low``."""
    def check(text: str) -> int:
        value = _number(int, text)
        if value < low:
            raise argparse.ArgumentTypeError(f"{value} is not allowed: must be >= {low}")
        return value

    check.__name__ = f"int_at_least_{low}"
    return check


positive_int = int_at_least(1)
non_negative_int = int_at_least(0)


def int_between(low: int, high: int):
    """An integer in ``low..high`` (both included)."""
    def check(text: str) -> int:
        value = _number(int, text)
        if not low <= value <= high:
            raise argparse.ArgumentTypeError(f"{value} is not allowed: must be in {low}..{high}")
        return value

    check.__name__ = f"int_between_{low}_{high}"
    return check


def positive_float(text: str) -> float:
    """A finite number > 0."""
    value = _number(float, text)
    if not 0 < value < float("inf"):
        raise argparse.ArgumentTypeError(f"{text} is not allowed: must be > 0")
    return value


def fraction(text: str) -> float:
    """A number in (0, 1]."""
    value = _number(float, text)
    if not 0 < value <= 1:
        raise argparse.ArgumentTypeError(f"{text} is not allowed: must be in (0, 1]")
    return value


def fractions(text: str) -> list[float]:
    """A comma-separated list of numbers in (0, 1], e.g. ``0.1,0.3,1``."""
    return [fraction(part.strip()) for part in text.split(",")]


def names(text: str) -> list[str]:
    """A comma-separated list of names, none empty."""
    parts = [part.strip() for part in text.split(",")]
    if not all(parts):
        raise argparse.ArgumentTypeError(f"{text!r}: an empty name in the comma-separated list")
    return parts


def resume(text: str) -> str:
    """``auto``, ``none`` or a complete checkpoint folder (one with meta.json)."""
    if text in ("auto", "none"):
        return text
    if not (Path(text) / META).is_file():
        raise argparse.ArgumentTypeError(
            f"{text!r} is not allowed: auto, none, or a complete checkpoint folder (with meta.json)")
    return text


def recipe(text: str) -> str:
    """A recipe file, or a shipped recipe's name (``recipes/cpu/demo.yaml`` works from any directory)."""
    from ..config import ConfigError, find_recipe

    try:
        return str(find_recipe(text))
    except ConfigError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def device(text: str) -> str:
    """``auto`` (a GPU when there is one), ``cpu``, ``cuda`` or ``cuda:N`` with N below the visible GPUs."""
    import re

    allowed = "allowed: auto, cpu, cuda, cuda:N"
    if text in ("auto", "cpu"):
        return text
    if not re.fullmatch(r"cuda(:\d+)?", text):
        raise argparse.ArgumentTypeError(f"{text!r} is not allowed; {allowed}")
    import torch

    index = int(text.partition(":")[2] or 0)
    if index >= torch.cuda.device_count():
        raise argparse.ArgumentTypeError(f"{text!r}: this machine has {torch.cuda.device_count()} visible GPU(s); "
                                         f"{allowed}")
    return text
