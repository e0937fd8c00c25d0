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
