"""The rich console of tables and rules: in a terminal its width; written to a file or a Slurm log (not a
terminal, where rich assumes 80 columns and cuts every column header to "str…") wide enough for the tables."""

from __future__ import annotations

from rich.console import Console

LOG_WIDTH = 200
"""Columns when the output is not a terminal."""


def console() -> Console:
    c = Console()
    return c if c.is_terminal else Console(width=LOG_WIDTH)
