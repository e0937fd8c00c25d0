"""Top-1/top-5 evaluation (convit_scale/evaluation.py): counts against a hand count, the ranks' padding left out,
per-class accuracy, uint8 batches normalised on the device, and the cap on batches."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from convit_scale.data.device_augment import normalize
from convit_scale.evaluation import Batches, evaluate, topk_counts

CLASSES = 7


def _logits(y: torch.Tensor, rank_of_truth: list[int]) -> torch.Tensor:
    """Logits whose true class is ranked ``rank_of_truth[i]`` (0: the top) in row i."""
    rows = []
    for label, rank in zip(y.tolist(), rank_of_truth):
        order = [c for c in range(CLASSES) if c != label]
        order.insert(rank, label)
        row = torch.empty(CLASSES)
        row[torch.tensor(order)] = torch.arange(CLASSES, 0, -1, dtype=torch.float32)
        rows.append(row)
    return torch.stack(rows)


def test_topk_counts_by_hand():
    y = torch.tensor([0, 1, 2, 3, 4, 5])
    logits = _logits(y, [0, 1, 4, 5, 0, 6])  # top-1: rows 0, 4; top-5: rows 0, 1, 2, 4
    c1, c5, loss, n = topk_counts(logits, y).tolist()
    assert (c1, c5, n) == (2, 4, 6) and loss == pytest.approx(F.cross_entropy(logits, y, reduction="sum").item())
    real = torch.tensor([True, True, True, False, False, True])
    assert topk_counts(logits, y, real)[[0, 1, 3]].tolist() == [1, 3, 4]


class _Padded(Batches):
    """A rank's share with padding at its end: the last ``pad`` samples repeat others and must not count."""

    def __init__(self, batches, pad: int):
        super().__init__(batches)
        self.num_real -= pad


def test_evaluate_counts_real_images_only_and_per_class():
    y = torch.tensor([0, 1, 2, 3, 0, 1, 2, 3])
    logits = _logits(y, [0, 0, 1, 6, 0, 2, 0, 0])  # the last two rows are padding
    x = torch.arange(8, dtype=torch.float32).view(8, 1)  # the "images" index the logits
    loader = _Padded([(x[:5], y[:5]), (x[5:], y[5:])], pad=2)
    result = evaluate(lambda images: logits[images.view(-1).long()], loader, torch.device("cpu"),
                      num_classes=CLASSES)
    assert result["samples"] == 6 and result["top1"] == pytest.approx(100 * 3 / 6)
    assert result["top5"] == pytest.approx(100 * 5 / 6)
    assert result["loss"] == pytest.approx(F.cross_entropy(logits[:6], y[:6]).item())
    per_class = result["per_class"]
    assert [c["images"] for c in per_class] == [2, 2, 1, 1, 0, 0, 0]
    assert [c["top1"] for c in per_class[:4]] == [100.0, 50.0, 0.0, 0.0]
    first = evaluate(lambda images: logits[images.view(-1).long()], loader, torch.device("cpu"), max_batches=1)
    assert first["samples"] == 5 and first["top1"] == pytest.approx(100 * 3 / 5)


def test_uint8_batches_are_normalised_before_the_forward():
    images = torch.randint(0, 256, (4, 3, 8, 8), dtype=torch.uint8)
    seen = []

    def forward(x):
        seen.append(x)
        return torch.zeros(len(x), CLASSES)

    evaluate(forward, Batches([(images, torch.zeros(4, dtype=torch.long))]), torch.device("cpu"))
    assert seen[0].dtype == torch.float32 and torch.equal(seen[0], normalize(images))
