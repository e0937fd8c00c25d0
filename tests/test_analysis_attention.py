"""Nonlocality (the paper's Eq. 8) and attention maps of GPSA heads (convit_scale/analysis/attention.py)."""

from __future__ import annotations

import math

import torch

from convit_scale import create_model
from convit_scale.analysis.attention import attention_maps, head_distances, nonlocality_of
from convit_scale.models.convit import GPSA, relative_positions


def test_nonlocality_of_conv_init_head_is_its_attention_centre_distance():
    grid = 8
    attn = GPSA(dim=36, num_heads=9, grid_size=grid, locality_strength=1.0)
    attn.init_weights()
    attn.locality_strength = 50.0  # a large alpha: each head attends to one offset (a 3x3 kernel)
    attn.local_init()
    with torch.no_grad():
        attn.gating_param.fill_(1e4)  # sigma = 1: purely positional
    a = attn.attention_map(torch.randn(2, grid * grid, 36))
    assert torch.allclose(a.sum(-1), torch.ones_like(a.sum(-1)), atol=1e-5)  # rows sum to 1
    d = nonlocality_of(a, grid)
    # Head (h1, h2) is peaked at the offset (h2 - 1, h1 - 1), so its Eq. 8 nonlocality over the queries
    # whose target lies inside the grid is the length of that offset.
    interior = torch.tensor([r * grid + c for r in range(1, grid - 1) for c in range(1, grid - 1)])
    dist = relative_positions(grid)[..., 2].sqrt()
    for h1 in range(3):
        for h2 in range(3):
            h = h1 + 3 * h2
            want = math.hypot(h2 - 1, h1 - 1)
            got = (a[:, h][:, interior] * dist[interior]).sum(-1).mean().item()
            assert abs(got - want) < 1e-3, (h, got, want)
    assert d[4].item() < 1e-3  # the centre head attends to its own patch everywhere
    assert d.max().item() < math.sqrt(2) + 1e-3


def test_head_distances_over_batches_equal_the_whole_set():
    """`analyze` measures 1,024 images a batch at a time: the weighted mean over batches is the whole set's."""
    torch.manual_seed(0)
    model = create_model("convit_nano", num_classes=4, img_size=16).eval()
    x = torch.randn(11, 3, 16, 16)
    per_head, n = head_distances(model, [(x[:4], None), (x[4:7], None), (x[7:], None)])
    whole = [nonlocality_of(a, model.grid_size).tolist() for a in attention_maps(model, x)]
    assert n == 11 and torch.allclose(torch.tensor(per_head, dtype=torch.float64),
                                      torch.tensor(whole, dtype=torch.float64), atol=1e-6)
