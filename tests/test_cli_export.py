"""``convit-scale export`` (convit_scale/cli/export.py): the checkpoint a user names (a run folder, RUN:best, a
checkpoint folder) is resolved as ``eval`` resolves it and exported to ``--out``, and the command says what it wrote.
The export itself, from real checkpoints: tests/test_trained.py, test_train_engine.py; its refusals:
tests/test_bad_input.py."""

from __future__ import annotations

from pathlib import Path

import pytest

from convit_scale.cli import main


@pytest.fixture
def exported(monkeypatch):
    calls = []

    def export(checkpoint, out):
        calls.append((checkpoint, out))
        return out

    monkeypatch.setattr("convit_scale.trained.export", export)
    return calls


def test_a_run_folder_exports_its_best_or_its_newest_checkpoint(exported, tmp_path, capsys):
    root = tmp_path / "run" / "checkpoints"
    for name in ("step_000000002", "step_000000004", "best"):
        (root / name).mkdir(parents=True)
        (root / name / "meta.json").write_text("{}")
    (root / "step_000000005").mkdir()  # incomplete (no meta.json): not the newest checkpoint
    out = tmp_path / "m.safetensors"
    for spec, chosen in ((f"{tmp_path / 'run'}:best", root / "best"), (str(tmp_path / "run"), root / "step_000000004"),
                         (str(root / "step_000000002"), root / "step_000000002")):
        assert main(["export", "--checkpoint", spec, "--out", str(out)]) == 0
        assert exported[-1] == (chosen, out) and isinstance(exported[-1][1], Path)
        assert capsys.readouterr().out.strip() == f"wrote {out} (from {chosen})"


@pytest.mark.parametrize("argv,words", [
    (["export", "--out", "m.safetensors"], ["the following arguments are required: --checkpoint"]),
    (["export", "--checkpoint", "RUN"], ["the following arguments are required: --out"]),
    (["export", "--checkpoint", "TMP:best", "--out", "m.safetensors"], ["has no best checkpoint yet"]),
])
def test_what_cannot_be_exported_is_one_error_line(argv, words, exported, tmp_path, capsys):
    (tmp_path / "checkpoints").mkdir()
    assert main([a.replace("TMP", str(tmp_path)) for a in argv]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: ") and len(err.splitlines()) == 1 and all(w in err for w in words), err
    assert not exported
