"""`bench distill` (convit_scale/bench/distill.py): the training's own distillation loss, timed."""

import torch
import torch.nn.functional as F

from convit_scale.bench import distill, worker
from convit_scale.train.loss import DistillLoss


def test_distill_bench_steps_with_the_training_loss():
    """`bench distill` times DistillLoss itself: hard distillation, alpha 0.5, teacher without gradients."""
    spec = {"student": "convit_nano", "teacher": "resnet18", "batch": 3, "img_size": 16, "steps": 1, "warmup": 1,
            "device": "cpu", "precision": "fp32"}
    w = distill.build(spec, torch.device("cpu"))
    assert isinstance(w.loss, DistillLoss) and w.optimizer is None
    assert not any(p.requires_grad for p in w.loss.teacher.parameters())
    x, y = torch.randn(3, 3, 16, 16), torch.tensor([0, 1, 2])
    logits = w.model(x)
    with torch.no_grad():
        hard = w.loss.teacher(x).argmax(1)
    expected = 0.5 * F.cross_entropy(logits, y) + 0.5 * F.cross_entropy(logits, hard)
    assert torch.allclose(w.loss(x, logits, y), expected)
    assert distill.build({**spec, "teacher": None}, torch.device("cpu")).loss is None
    assert worker.timed_step(spec, distill.build)["images_per_s"] > 0
