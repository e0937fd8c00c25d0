"""The rich console of tables and rules, and tables that fit it.

In a terminal the console is the terminal's width, or ``COLUMNS`` when the environment sets it; written to a file
or a Slurm log (not a terminal, where rich would assume 80 columns and cut every column header to "str…") it is
wide enough for the tables. A table wider than the console is folded by :func:`print_table`: its columns are split
into several tables that each fit, each repeating the key column (the model or strategy), so no name is cut.
"""

from __future__ import annotations

import copy
import dataclasses
import os

from rich.console import Console
from rich.measure import Measurement
from rich.table import Table

LOG_WIDTH = 200
"""Columns when the output is not a terminal and ``COLUMNS`` is not set."""


def console() -> Console:
    c = Console()
    return c if c.is_terminal or os.environ.get("COLUMNS", "").isdigit() else Console(width=LOG_WIDTH)


def print_table(table: Table, key_columns: int = 1, out: Console | None = None) -> None:
    """Print ``table`` whole when it fits the console's width; otherwise folded: the columns after the first
    ``key_columns`` are split, in order, into tables that each fit, every one starting with the key columns. The key
    columns never wrap; no cell is cut or wrapped as long as the key columns and any one other column fit."""
    out = out or console()
    for part in fold_table(table, out.width, key_columns, out):
        out.print(part)


def fold_table(table: Table, width: int, key_columns: int = 1, out: Console | None = None) -> list[Table]:
    """The tables :func:`print_table` prints for a console ``width`` columns wide (``[table]`` when it fits)."""
    out = out or Console(width=width)
    if natural_width(table, out) <= width or len(table.columns) <= key_columns + 1:
        return [table]
    keys = [dataclasses.replace(c, no_wrap=True) for c in table.columns[:key_columns]]
    groups: list[list] = [[]]
    for column in table.columns[key_columns:]:
        if groups[-1] and natural_width(_with_columns(table, keys + groups[-1] + [column]), out) > width:
            groups.append([])
        groups[-1].append(column)
    parts = [_with_columns(table, keys + group) for group in groups]
    for i, part in enumerate(parts[1:], 2):
        part.title = f"{table.title} ({i}/{len(parts)})" if table.title else None
    if table.title:
        parts[0].title = f"{table.title} (1/{len(parts)})"
    return parts


def natural_width(table: Table, out: Console) -> int:
    """The columns ``table`` takes with no cell wrapped or cut."""
    return Measurement.get(out, out.options.update_width(10**6), table).maximum


def _with_columns(table: Table, columns: list) -> Table:
    part = copy.copy(table)
    part.columns = [dataclasses.replace(c, _index=i) for i, c in enumerate(columns)]
    return part
