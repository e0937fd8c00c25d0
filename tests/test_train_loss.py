"""The training loss (convit_scale/train/loss.py): cross-entropy with label smoothing or soft targets, and DeiT's
distillation terms (hard and soft, with or without a distillation token) against their formulas."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from convit_scale.config import DistillConfig, load_config
from convit_scale.train.loss import DistillLoss, base_loss

TEACHER = "regnety_002"


@pytest.fixture(scope="module")
def teacher_file(tmp_path_factory):
    """A RegNetY with random weights in a safetensors file: the formulas hold for any teacher."""
    import timm
    from safetensors.torch import save_file

    torch.manual_seed(0)
    path = tmp_path_factory.mktemp("teacher") / "teacher.safetensors"
    save_file({k: v.contiguous() for k, v in timm.create_model(TEACHER, num_classes=10).state_dict().items()},
              str(path))
    return path


def test_soft_distillation_is_deits_formula(teacher_file):
    """soft: tau^2 x KL(teacher || student) at temperature tau, averaged over batch and classes (DeiT),
    mixed with the label loss by alpha; zero when the student already matches the teacher."""
    import timm
    from safetensors.torch import load_file

    from convit_scale.config import DistillConfig
    from convit_scale.train.loss import DistillLoss

    teacher = timm.create_model(TEACHER, num_classes=10)
    teacher.load_state_dict(load_file(str(teacher_file)))
    x, y = torch.randn(6, 3, 16, 16), torch.randint(0, 10, (6,))
    student = torch.randn(6, 10)
    ce = torch.nn.functional.cross_entropy
    with torch.no_grad():
        t = teacher.eval()(x)
    for tau in (1.0, 3.0):
        loss = DistillLoss(ce, teacher, DistillConfig(type="soft", alpha=1.0, tau=tau))
        pt, ps = (t / tau).softmax(1), (student / tau).softmax(1)
        by_hand = (pt * (pt.log() - ps.log())).sum() * tau**2 / student.numel()
        assert torch.allclose(loss(x, student, y), by_hand, atol=1e-6)
        assert loss(x, t.clone(), y).abs() < 1e-6
    mixed = DistillLoss(ce, teacher, DistillConfig(type="soft", alpha=0.25, tau=2.0))
    pure = DistillLoss(ce, teacher, DistillConfig(type="soft", alpha=1.0, tau=2.0))
    assert torch.allclose(mixed(x, student, y), 0.75 * ce(student, y) + 0.25 * pure(x, student, y), atol=1e-6)


def test_hard_distillation_is_deits_formula_with_and_without_a_token():
    """hard: (1 - alpha) x base(class logits, labels) + alpha x CE(distillation logits, argmax of the teacher); with a
    distillation token the student's second head learns from the teacher, without one the same logits learn both."""
    import timm

    torch.manual_seed(0)
    teacher = timm.create_model(TEACHER, num_classes=10)
    x, y = torch.randn(6, 3, 16, 16), torch.randint(0, 10, (6,))
    cls_logits, dist_logits = torch.randn(6, 10), torch.randn(6, 10)
    with torch.no_grad():
        t_label = teacher.eval()(x).argmax(1)
    teacher.train()  # the loss puts the teacher in evaluation mode itself
    loss = DistillLoss(F.cross_entropy, teacher, DistillConfig(type="hard", alpha=0.5))
    by_hand = 0.5 * F.cross_entropy(cls_logits, y) + 0.5 * F.cross_entropy(dist_logits, t_label)
    assert torch.allclose(loss(x, (cls_logits, dist_logits), y), by_hand, atol=1e-6)
    assert not teacher.training
    no_token = 0.5 * F.cross_entropy(cls_logits, y) + 0.5 * F.cross_entropy(cls_logits, t_label)
    assert torch.allclose(loss(x, cls_logits, y), no_token, atol=1e-6)


def test_base_loss_smooths_labels_or_takes_mixed_targets():
    """Without Mixup/CutMix: cross-entropy with data.label_smoothing; with them: soft-target cross-entropy on the
    mixed targets (which carry the smoothing), the same number for a smoothed one-hot target."""
    logits, y = torch.randn(5, 10), torch.randint(0, 10, (5,))
    plain = base_loss(load_config(None, ["data.mixup=0", "data.cutmix=0", "data.label_smoothing=0.1"]))
    assert torch.allclose(plain(logits, y), F.cross_entropy(logits, y, label_smoothing=0.1))
    assert not torch.allclose(plain(logits, y), F.cross_entropy(logits, y))
    mixed = base_loss(load_config(None, ["data.mixup=0.8", "data.cutmix=1.0"]))
    smoothed = torch.full((5, 10), 0.01).scatter_(1, y.view(-1, 1), 0.91)
    assert torch.allclose(mixed(logits, smoothed), F.cross_entropy(logits, y, label_smoothing=0.1), atol=1e-6)
