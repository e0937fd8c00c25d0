"""Tables that fit the terminal (convit_scale/console.py): folded into several tables that each repeat the key
column, never a name cut; `models` and `plan` at COLUMNS=80."""

from __future__ import annotations

import re

import pytest
from rich.console import Console
from rich.table import Table
from support import REPO

from convit_scale.cli import main
from convit_scale.console import fold_table, natural_width

NAMES = ["convit_small_plus", "deit_base_plus", "convit_tiny"]


def _table(columns: int) -> Table:
    t = Table(title="a table")
    t.add_column("model")
    for i in range(columns):
        t.add_column(f"column {i}", justify="right")
    for name in NAMES:
        t.add_row(name, *(f"{1000 + i}.25" for i in range(columns)))
    return t


def _text(tables, width: int) -> str:
    out = Console(width=width, record=True, file=open("/dev/null", "w"))
    for t in tables:
        out.print(t)
    return out.export_text()


def test_a_table_that_fits_is_printed_whole():
    t = _table(3)
    assert natural_width(t, Console(width=200)) < 80 and fold_table(t, 80) == [t]


@pytest.mark.parametrize("width", [80, 60, 40])
def test_a_wide_table_is_folded_each_part_repeating_the_key_column(width):
    t = _table(12)
    assert natural_width(t, Console(width=200)) > 80
    parts = fold_table(t, width)
    assert len(parts) > 1
    text = _text(parts, width)
    assert max(len(line) for line in text.splitlines()) <= width
    assert "…" not in text
    for part in parts:
        assert part.columns[0].header == "model"
        assert [c for c in part.columns[0].cells] == NAMES
    # every column once, in order, whole (header and cells)
    headers = [c.header for part in parts for c in part.columns[1:]]
    assert headers == [f"column {i}" for i in range(12)]
    for i in range(12):
        assert f"column {i}" in text and f"{1000 + i}.25" in text
    assert [p.title for p in parts] == [f"a table ({i}/{len(parts)})" for i in range(1, len(parts) + 1)]


def _check_80_columns(out: str, names: list[str], key: str):
    lines = out.splitlines()
    assert max(len(line) for line in lines if "│" in line or "┃" in line) <= 80
    assert "…" not in out
    rows = [line for line in lines if line.startswith("│")]
    for name in names:  # the name whole in its cell, in every part of the folded table
        cells = [re.split(r"\s*│\s*", r)[1] for r in rows]
        assert cells.count(name) >= 2, (name, cells)
    assert out.count(f"┃ {key}") >= 2  # folded: the key column heads every part


def test_models_at_80_columns_shows_whole_names(capsys, monkeypatch):
    from convit_scale.models import MODELS

    monkeypatch.setenv("COLUMNS", "80")
    assert main(["models"]) == 0
    _check_80_columns(capsys.readouterr().out, list(MODELS), "model")


def test_plan_at_80_columns_shows_whole_strategy_names(capsys, monkeypatch):
    monkeypatch.chdir(REPO)
    monkeypatch.setenv("COLUMNS", "80")
    assert main(["plan", "--recipe", "recipes/table1/convit_base_plus.yaml", "--nodes", "2",
                 "--gpu", "h200-141gb"]) == 0
    out = capsys.readouterr().out
    _check_80_columns(out, ["ddp", "fsdp2", "zero1", "zero2", "zero3"], "layout")
    assert "Memory per GPU (GiB)" in out and "┃ total" in out and "wall-clock h" in out
    too_wide = [line for line in out.splitlines() if len(line) > 80]
    assert not too_wide, too_wide  # the prose after the tables is folded too: time, links, loader, checkpoints
    assert "\nrecommended: " in out and "\ncheckpoints: " in out and "\n  " in out
