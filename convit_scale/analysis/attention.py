"""What the paper measures inside the model: gating, attention maps, nonlocality (the paper's Section 4: Fig. 5-7,
Eq. 8)."""

from __future__ import annotations

import torch

from ..models.convit import GPSA, ConViT, relative_positions


def gating(model: ConViT) -> list[list[float]]:
    """sigmoid(lambda_h) per GPSA layer and head (Fig. 6)."""
    return [blk.attn.gating().tolist() for blk in model.gpsa_blocks()]


@torch.no_grad()
def attention_maps(model: ConViT, images: torch.Tensor) -> list[torch.Tensor]:
    """Per layer, the (B, H, L, L) attention among patch tokens for these images.

    For plain attention layers the patch-to-patch block of the (T, T) map is returned.
    """
    inputs: dict[int, torch.Tensor] = {}
    hooks = [blk.norm1.register_forward_hook(lambda m, a, out, i=i: inputs.__setitem__(i, out))
             for i, blk in enumerate(model.blocks)]
    try:
        model.eval()
        model.forward_features(images)
    finally:
        for h in hooks:
            h.remove()
    maps, n_patches = [], model.patch_embed.num_patches
    for i, blk in enumerate(model.blocks):
        if isinstance(blk.attn, GPSA):
            maps.append(blk.attn.attention_map(inputs[i]))
        else:
            maps.append(blk.attn.attention_map(inputs[i])[:, :, -n_patches:, -n_patches:])
    return maps


def nonlocality_of(attn: torch.Tensor, grid_size: int) -> torch.Tensor:
    """Eq. 8 per head: D_loc = (1/L) sum_ij A_ij ||delta_ij|| in patch units, averaged over the batch."""
    dist = relative_positions(grid_size, device=attn.device)[..., 2].sqrt()  # (L, L)
    return (attn.float() * dist).sum(dim=(-1, -2)).mean(dim=0) / attn.shape[-1]  # (H,)


@torch.no_grad()
def nonlocality(model: ConViT, images: torch.Tensor) -> list[float]:
    """Nonlocality per layer (mean over heads), for GPSA and plain attention layers alike (Fig. 5)."""
    return [nonlocality_of(a, model.grid_size).mean().item() for a in attention_maps(model, images)]


@torch.no_grad()
def head_distances(model: ConViT, batches, device: torch.device | str = "cpu") -> tuple[list[list[float]], int]:
    """Nonlocality per layer and head (patch units) averaged over every image of ``batches`` ((x, y) pairs,
    moved to ``device`` one at a time: (B, H, L, L) maps per layer are never held for more than one batch),
    and the number of images."""
    sums, n = None, 0
    for x, _ in batches:
        x = x.to(device, non_blocking=True)
        per_layer = torch.stack([nonlocality_of(a, model.grid_size) for a in attention_maps(model, x)]).double()
        sums = per_layer * len(x) if sums is None else sums + per_layer * len(x)
        n += len(x)
    return (sums / max(n, 1)).tolist(), n
