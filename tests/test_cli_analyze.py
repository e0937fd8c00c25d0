"""`convit-scale analyze` (convit_scale/cli/analyze.py): the images and the device asked for."""

from __future__ import annotations

import torch

from convit_scale import create_model


def test_analyze_command_measures_the_images_asked_for(fm_wds, tmp_path, capsys):
    """Default: at least 1,000 validation images, on the GPU when there is one; here 40 on the CPU, and a device
    the machine does not have is refused before any work."""
    import json

    from safetensors.torch import save_file

    from convit_scale.analysis.report import ANALYSIS_IMAGES
    from convit_scale.cli import build_parser, main

    args = build_parser().parse_args(["analyze", "--checkpoint", "m", "--data", "d", "--out", "o"])
    assert args.images == ANALYSIS_IMAGES >= 1000 and args.device == "auto"
    weights = tmp_path / "m.safetensors"
    save_file(create_model("convit_nano", num_classes=10).state_dict(), str(weights))
    out = tmp_path / "analysis"
    argv = ["analyze", "--checkpoint", str(weights), "--model", "convit_nano", "--data", str(fm_wds),
            "--out", str(out), "--images", "40"]
    assert main([*argv, "--device", "cpu"]) == 0
    result = json.loads((out / "analysis.json").read_text())
    assert result["images"] == 40 and result["device"] == "cpu" and len(result["attention_distance_px"]) == 3
    capsys.readouterr()
    bad = f"cuda:{torch.cuda.device_count()}"
    assert main([*argv, "--device", bad]) == 2
    assert f"'{bad}'" in capsys.readouterr().err


def _fake_run(root, name: str, model: str, folder: str, metrics: list[dict]):
    """A run folder as training leaves it: a checkpoint holding the consolidated weights and meta.json, and
    metrics.jsonl (one evaluation)."""
    import json

    from safetensors.torch import save_file

    ckpt = root / name / "checkpoints" / folder
    ckpt.mkdir(parents=True)
    save_file(create_model(model, num_classes=10).state_dict(), str(ckpt / "model.safetensors"))
    (ckpt / "meta.json").write_text(json.dumps({"step": 1, "config": {"model": {"name": model, "num_classes": 10},
                                                                      "data": {}}}))
    (root / name / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in metrics))
    return root / name


def test_analyze_of_a_deit_against_a_convit_run(fm_wds, tmp_path, capsys, monkeypatch):
    """Before: a DeiT's analysis ended in `error: max() arg is an empty sequence` (the gating of no GPSA layer);
    --compare took no RUN or RUN:best; Fig. 5 left out the compared model's nonlocality; the plots named the
    checkpoint folder (`best`); a history of one evaluation drew no point; the masking was only a dict printed."""
    import json
    import re

    from convit_scale.analysis import plots
    from convit_scale.cli import main

    torch.manual_seed(0)
    one_eval = [{"kind": "train", "step": 1, "loss": 2.3, "lr": 1e-3}, {"kind": "eval", "epoch": 0, "top1": 10.0,
                                                                       "top5": 50.0}]
    deit = _fake_run(tmp_path, "deit_run", "deit_nano", "best",
                     [*one_eval, {"kind": "analysis", "epoch": 0, "gating": [], "nonlocality": [1.0, 1.1, 1.2]}])
    convit = _fake_run(tmp_path, "convit_run", "convit_nano", "step_000000001", one_eval)
    figures = {}
    save = plots._save
    monkeypatch.setattr(plots, "_save", lambda fig, path: figures.setdefault(path.name, [
        line.get_marker() for ax in fig.axes for line in ax.lines]) is not None and save(fig, path))
    out = tmp_path / "analysis"
    assert main(["analyze", "--checkpoint", f"{deit}:best", "--compare", str(convit), "--data", str(fm_wds),
                 "--out", str(out), "--images", "40", "--device", "cpu"]) == 0
    printed = capsys.readouterr().out
    result = json.loads((out / "analysis.json").read_text())
    assert result["gating"] == [] and "gating.png" not in figures and "gating_history.png" not in figures
    assert result["names"] == ["deit_nano (deit_run)", "convit_nano (convit_run)"]
    assert len(result["compare_nonlocality"]) == 3 and "nonlocality.png" in figures
    assert set(figures["nonlocality_history.png"]) == {"o"}  # one evaluation: its point is drawn
    rows = (out / "masking_top1.csv").read_text().splitlines()
    assert rows[0] == "condition,top1" and [r.split(",")[0] for r in rows[1:]] == ["none", "position_embedding"]
    assert re.search(r"masking top-1 on 40 images \(%\): none \d+\.\d\d, position_embedding \d+\.\d\d$",
                     printed, re.M), printed
    assert main(["analyze", "--checkpoint", str(deit / "checkpoints" / "best"), "--compare", f"{convit}:best",
                 "--data", str(fm_wds), "--out", str(out), "--images", "40", "--device", "cpu"]) == 2
    assert "the run has no best checkpoint yet" in capsys.readouterr().err
