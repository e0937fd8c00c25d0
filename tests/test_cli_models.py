"""``convit-scale models`` (convit_scale/cli/models.py): one row per registered model, counted from the module, beside
the paper's Table 1 (the counts against Table 1: tests/test_models_registry.py; the table at 80 columns:
tests/test_console.py)."""

from __future__ import annotations

from convit_scale.cli import main
from convit_scale.cli.models import model_table_rows
from convit_scale.models import MODELS


def test_one_row_per_model_from_its_spec():
    rows = model_table_rows()
    assert [r["name"] for r in rows] == list(MODELS)
    for r in rows:
        spec = MODELS[r["name"]]
        assert r["heads"] * r["head_dim"] == r["width"] == spec.embed_dim and r["heads"] == spec.num_heads
        assert r["gpsa_layers"] == spec.local_up_to_layer and (r["gpsa_layers"] == 0) == r["name"].startswith("deit")
        assert 0 < r["params_m"] < 200 and 0 < r["gmacs"] < 50


def test_the_printed_table_has_every_models_counts(capsys, monkeypatch):
    monkeypatch.delenv("COLUMNS", raising=False)  # not a terminal: the table is as wide as it needs
    assert main(["models"]) == 0
    out = capsys.readouterr().out
    lines = {line.split()[1]: line for line in out.splitlines() if line.split()[1:2] and line.split()[1] in MODELS}
    assert set(lines) == set(MODELS)
    for r in model_table_rows():
        cells = lines[r["name"]].replace("│", " ").split()
        assert f"{r['params_m']:.2f}" in cells and f"{r['gmacs']:.2f}" in cells, lines[r["name"]]
        if r["paper_top1"] is None:
            assert cells[-1] == "-"
        else:
            assert cells[-1] == f"{r['paper_top1']:.1f}"


def test_tables_written_to_a_file_keep_their_headers(capsys, monkeypatch):
    """Not a terminal (a file, a Slurm log): the table is as wide as it needs, no header cut to "par…"."""
    monkeypatch.delenv("COLUMNS", raising=False)  # COLUMNS, when set, is the width (tests/test_console.py)
    assert main(["models"]) == 0
    out = capsys.readouterr().out
    assert "params (M)" in out and "GPSA layers" in out and "…" not in out
