"""Top-1/top-5 counting: the one counter used by training's evaluation, ``convit-scale eval`` and analysis."""

from __future__ import annotations

import torch
import torch.nn.functional as F


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
