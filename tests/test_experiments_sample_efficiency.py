"""The CPU Table 2: every seed's runs, the images each run trained on, and each gap with its noise."""

import math
from pathlib import Path

import pytest

from convit_scale.experiments import sample_efficiency as se


def test_summary_states_each_gap_with_its_noise(monkeypatch):
    steps = {"0.05": 720, "1": 1128}  # 240 epochs x 3 full batches of 128 (500 images), 12 x 94 (12,000 images)
    monkeypatch.setattr(se, "_ends", lambda run: [{"step": steps[run.name.split("_f")[1].split("_")[0]]}])
    runs, results = [], []
    for f, tops in ((0.05, {0: (77.0, 73.0), 1: (78.0, 75.0)}), (1.0, {0: (81.0, 81.5), 1: (80.0, 81.5)})):
        for seed, (convit, deit) in tops.items():
            for model, top1 in (("convit_micro", convit), ("deit_micro", deit)):
                runs.append((model, f, seed, Path(f"{model}_f{f:g}" + (f"_s{seed}" if seed else "")), []))
                results.append(top1)
    out = se._summary(runs, results, [0.05, 1.0], {0.05: 240, 1.0: 12}, ["convit_micro", "deit_micro"], 128, 2000)
    assert out["images_trained_on"] == {"0.05": 92_160, "1": 144_384}  # not 120,000 at f = 0.05: drop_last
    assert out["table"]["convit_micro"]["0.05"] == 77.5 and out["per_seed"]["deit_micro"]["0.05"] == [73.0, 75.0]
    g = out["gaps"]["0.05"]
    assert g["gap"] == pytest.approx(3.5) and g["per_seed"] == [4.0, 3.0]
    p, q = 0.775, 0.74
    assert g["sampling_se"] == pytest.approx(100 * math.hypot(math.sqrt(p * (1 - p) / 2000),
                                                               math.sqrt(q * (1 - q) / 2000)))
    assert "| 0.05 | 240 | 92,160 | 77.50 | 74.00 | +3.50 |" in out["markdown"]
