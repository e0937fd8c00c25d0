"""Sub-commands that start work: prep, train, eval, export, analyze, bench, demo."""

from __future__ import annotations


def add_subcommands(sub) -> None:
    """Register the work commands on the ``convit-scale`` parser."""
