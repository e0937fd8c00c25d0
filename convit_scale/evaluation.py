"""Top-1/top-5 evaluation, sharded over the ranks: the one loop behind training's evaluation, the teacher check,
``convit-scale eval`` and the analysis's masked accuracies."""

from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F

from . import comm
from .data.device_augment import normalize


def topk_counts(logits: torch.Tensor, y: torch.Tensor, real: torch.Tensor | None = None) -> torch.Tensor:
    """(correct@1, correct@5, loss sum, samples) over the rows where ``real`` is true (padding excluded), as a
    float64 tensor on the logits' device: accumulate it across batches and reduce it once."""
    logits = logits.float()
    if real is None:
        real = torch.ones(len(y), dtype=torch.bool, device=y.device)
    k = min(5, logits.shape[1])
    hit = logits.topk(k, dim=1).indices == y[:, None]  # (B, k)
    loss = F.cross_entropy(logits, y, reduction="none")
    realf = real.to(torch.float64)
    return torch.stack([(hit[:, 0] * realf).sum(), (hit.any(1) * realf).sum(), (loss.double() * realf).sum(),
                        realf.sum()])


def summarize(counts: torch.Tensor) -> dict:
    """top-1 / top-5 in percent, mean loss and the number of images from (reduced) ``topk_counts``."""
    c1, c5, loss, n = counts.tolist()
    n_safe = max(n, 1.0)
    return {"top1": 100 * c1 / n_safe, "top5": 100 * c5 / n_safe, "loss": loss / n_safe, "samples": int(n)}


def class_counts(logits: torch.Tensor, y: torch.Tensor, real: torch.Tensor, num_classes: int) -> torch.Tensor:
    """(correct@1 per class, images per class), concatenated: (2 * num_classes,) float64 on the logits' device.
    index_add_, not bincount or boolean indexing, whose output sizes would make a CUDA run wait for the host."""
    counts = torch.zeros(2, num_classes, dtype=torch.float64, device=logits.device)
    counts[0].index_add_(0, y, ((logits.argmax(1) == y) & real).to(torch.float64))
    counts[1].index_add_(0, y, real.to(torch.float64))
    return counts.flatten()


@torch.no_grad()
def evaluate(forward, loader, device: torch.device, max_batches: int | None = None,
             num_classes: int | None = None) -> dict:
    """Top-1/top-5 and mean loss of ``forward`` over ``loader``'s evaluation epoch; with ``num_classes``, also
    ``per_class``: [{"top1", "images"}] per label (in the same reduction).

    Each rank counts its own share on ``device`` (uint8 batches are normalised there), the padding that evens the
    ranks out (past ``loader.num_real``) does not count, and one reduction adds the counts up: every rank returns
    the same numbers. Every rank runs the same number of forwards (a sharded model's forward is a collective).
    An image the loader could not decode comes with label -1 (ImageFolder's evaluation): it is not scored, and
    ``undecodable`` names its file (every rank's, gathered only when there is one).
    ``loader``: a data loader, or anything with ``epoch(0)`` yielding (x, y) and ``num_real``."""
    counts = torch.zeros(5 + 2 * (num_classes or 0), dtype=torch.float64, device=device)  # 4: undecodable
    seen, undecodable = 0, []
    with contextlib.closing(iter(loader.epoch(0))) as batches:
        for i, batch in enumerate(batches):
            if max_batches is not None and i >= max_batches:
                break
            x, y = batch
            undecodable += [b["file"] for b in getattr(batch, "bad", ()) if b.get("scored") is False]
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            if x.dtype == torch.uint8:  # resized and cropped on the CPU, normalised here
                x = normalize(x)
            image = (torch.arange(len(y), device=device) + seen) < loader.num_real  # not the ranks' padding
            real, y = image & (y >= 0), y.clamp_min(0)
            seen += len(y)
            logits = forward(x)
            counts[:4] += topk_counts(logits, y, real)
            counts[4] += (image & ~real).sum()
            if num_classes:
                counts[5:] += class_counts(logits, y, real, num_classes)
    counts = comm.all_reduce(counts)
    result = summarize(counts[:4])
    # the same count on every rank: all gather, or none does; a padding rank's copy of a file is listed once
    result["undecodable"] = sorted({f for files in comm.all_gather_object(undecodable) for f in files}) \
        if counts[4] > 0 else []
    if num_classes:
        correct, images = counts[5:].view(2, num_classes).tolist()
        result["per_class"] = [{"top1": 100 * c / max(n, 1.0), "images": int(n)} for c, n in zip(correct, images)]
    return result


def resolve_device(name: str = "auto") -> torch.device:
    """``auto``: the GPU when there is one; otherwise the named device (``cpu``, ``cuda``, ``cuda:N``)."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


class Batches:
    """Batches already in memory (x, y), behind the loader interface ``evaluate`` reads; every image counts."""

    def __init__(self, batches: list[tuple[torch.Tensor, torch.Tensor]]):
        self.batches = batches
        self.num_real = sum(len(y) for _, y in batches)

    def epoch(self, epoch: int = 0):
        yield from self.batches
