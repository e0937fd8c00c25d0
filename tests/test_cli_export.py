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


def test_a_deit_export_loads_into_timm_as_its_docs_say_and_predicts_as_the_run(tmp_path, capsys):
    """The export is what timm builds for the model: a DeiT's ``pos_embed`` has the class token's row (197 at 224
    pixels, ours 196) and loads strictly into timm's ``deit_*`` by README's ``timm.create_model`` line; the
    project reads its own export back to the same model."""
    import dataclasses
    import json

    import timm
    import torch
    from safetensors.torch import save_file

    from convit_scale import create_model
    from convit_scale.config import load_config
    from convit_scale.trained import load_trained_model

    cfg = load_config(None, ["model.name=deit_tiny", "model.num_classes=10"])
    torch.manual_seed(0)
    model = create_model("deit_tiny", num_classes=10).eval()
    best = tmp_path / "run" / "checkpoints" / "best"
    best.mkdir(parents=True)
    save_file(model.state_dict(), str(best / "model.safetensors"))
    config = {"model": dataclasses.asdict(cfg.model), "data": dataclasses.asdict(cfg.data)}
    (best / "meta.json").write_text(json.dumps({"config": config, "step": 3}))
    out = tmp_path / "deit_tiny.safetensors"
    assert main(["export", "--checkpoint", f"{tmp_path / 'run'}:best", "--out", str(out)]) == 0
    capsys.readouterr()

    docs = (Path(__file__).parents[1] / "docs" / "evaluation.md").read_text()
    assert 'timm.create_model("deit_small_patch16_224", pretrained=True,' in docs
    assert "pretrained_cfg_overlay=dict(file=" in docs and "`num_classes=N` to `pretrained_cfg_overlay`" in docs
    ref = timm.create_model("deit_tiny_patch16_224", pretrained=True,  # the file, strictly: nothing downloads
                            pretrained_cfg_overlay=dict(file=str(out), num_classes=10)).eval()
    assert ref.pos_embed.shape == (1, 197, 192) and ref.num_classes == 10
    x = torch.randn(2, 3, 224, 224)
    with torch.no_grad():
        want = model(x)
        assert (ref(x) - want).abs().max().item() < 1e-5
        assert torch.equal(load_trained_model(out)(x), want)
