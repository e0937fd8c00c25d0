"""The analysis a run logs at every evaluation: gating per GPSA layer and head, nonlocality per layer (the
histories of Fig. 5 and 6), sharded over the ranks on the training device."""

from __future__ import annotations

import contextlib
import math

import torch

from .. import comm
from ..config import Config, model_options
from ..data.device_augment import normalize
from ..models import create_model
from .attention import attention_maps, gating, nonlocality_of


@torch.no_grad()
def epoch_analysis(full_state: dict | None, cfg: Config, loader, ctx) -> dict | None:
    """Gating per GPSA layer and head, and nonlocality per layer on up to ``log.analysis_images`` validation images:
    each rank takes its share of its own validation images on its device with a full copy of the weights (rank 0's
    ``full_state``, broadcast), and one reduction adds the sums up. Every rank calls it; returned on rank 0."""
    if loader is None or cfg.log.analysis_images == 0:
        return None
    plain = create_model(cfg.model.name, device=ctx.device, **{**model_options(cfg.model), "drop_path_rate": 0.0})
    if ctx.is_main:
        plain.load_state_dict(full_state)
    comm.broadcast_tensors(list(plain.state_dict().values()))
    share = math.ceil(cfg.log.analysis_images / ctx.world_size)
    sums = torch.zeros(len(plain.blocks) + 1, dtype=torch.float64, device=ctx.device)  # per layer, then images
    seen = taken = 0
    with contextlib.closing(loader.epoch(0)) as batches:
        for x, _ in batches:
            n = min(len(x), loader.num_real - seen, share - taken)  # real images of this rank's share
            seen, taken = seen + len(x), taken + max(n, 0)
            if n <= 0:
                break
            for i in range(0, n, 32):  # (B, H, L, L) maps per layer: a few at a time
                chunk = x[i:min(n, i + 32)].to(ctx.device, non_blocking=True)
                chunk = normalize(chunk) if chunk.dtype == torch.uint8 else chunk  # device-augmentation mode
                maps = attention_maps(plain, chunk)
                sums[:-1] += torch.stack([nonlocality_of(a, plain.grid_size).mean()
                                          for a in maps]).double() * len(chunk)
                sums[-1] += len(chunk)
    total = comm.all_reduce(sums).tolist()
    if not ctx.is_main:
        return None
    return {"gating": gating(plain), "nonlocality": [v / max(total[-1], 1) for v in total[:-1]],
            "analysis_images": int(total[-1])}
