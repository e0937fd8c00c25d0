"""The figures (convit_scale/analysis/plots.py): each written as a PNG of the measures it is given, without a display,
a panel per GPSA layer where the figure has one."""

from __future__ import annotations

import torch
from PIL import Image

from convit_scale.analysis import plots


def _png(path) -> tuple[int, int]:
    with Image.open(path) as img:
        assert img.format == "PNG"
        return img.size


def test_every_figure_is_written_as_a_png(tmp_path):
    gates = [[0.9, 0.2, 0.5, 0.7], [0.1, 0.4, 0.6, 0.8]]  # 2 GPSA layers of 4 heads
    maps = [torch.softmax(torch.randn(1, 4, 16, 16), -1) for _ in range(3)]  # 3 layers, a 4 x 4 grid
    made = [
        plots.gating_heatmap(gates, tmp_path / "gating.png"),
        plots.nonlocality_per_layer([3.0, 2.5, 1.0], 2, tmp_path / "nonlocality.png"),
        plots.attention_maps(maps, torch.randn(3, 32, 32), 5, 4, gates, tmp_path / "maps.png"),
        plots.attention_distance([[10.0, 12.0], [20.0, 4.0]], tmp_path / "distance.png"),
        plots.cka_heatmap([[1.0, 0.5], [0.5, 1.0]], "convit", "deit", tmp_path / "cka.png"),
        plots.gating_history({"epoch": [0, 1, 2], "gating": [gates] * 3}, tmp_path / "gating_history.png"),
        plots.nonlocality_history({"epoch": [0, 1], "nonlocality": [[3.0, 2.0], [2.0, 1.0]]}, tmp_path / "nl.png"),
        plots.training_curves({"step": [1, 2], "loss": [2.3, 2.1], "lr": [1e-4, 2e-4], "eval_epoch": [0],
                               "top1": [10.0], "top5": [50.0], "paper_top1": 81.3}, tmp_path / "curves.png"),
        plots.sample_efficiency({"convit_tiny": {"0.1": 20.0, "1": 60.0}}, tmp_path / "table2.png"),
    ]
    assert [p.name for p in made] == ["gating.png", "nonlocality.png", "maps.png", "distance.png", "cka.png",
                                      "gating_history.png", "nl.png", "curves.png", "table2.png"]
    sizes = {p.name: _png(p) for p in made}
    one_layer = plots.gating_history({"epoch": [0, 1], "gating": [gates[:1]] * 2}, tmp_path / "one.png")
    assert _png(one_layer)[0] < sizes["gating_history.png"][0]  # a panel per layer: one layer, a narrower figure
