"""Seeded drop-path (convit_scale/models/convit.py): timm's stochastic depth, decided per sample from its seed."""

from __future__ import annotations

import torch
from timm.layers import DropPath

from convit_scale.models import create_model
from convit_scale.models.convit import SeededDropPath


def test_keep_rate_per_block_is_one_minus_the_linear_rate():
    """Each block keeps a branch with probability 1 - p_b, p_b rising linearly to drop_path_rate (timm's, DeiT's)."""
    model = create_model("convit_nano", num_classes=10, drop_path_rate=0.3)
    keep = model.drop_path_keep(torch.arange(20000, dtype=torch.int64) * 7919 + 3)  # (depth, 2, B)
    rates = torch.tensor([blk.drop_path.drop_prob for blk in model.blocks], dtype=torch.float64)
    assert keep.shape == (len(model.blocks), 2, 20000) and set(keep.unique().tolist()) <= {0.0, 1.0}
    assert torch.allclose(rates, torch.linspace(0, 0.3, len(model.blocks), dtype=torch.float64))
    observed = keep.double().mean(dim=2)  # (depth, 2)
    sigma = (rates * (1 - rates) / 20000).sqrt().clamp(min=1e-9)
    assert ((observed - (1 - rates)[:, None]).abs() <= 4 * sigma[:, None] + 1e-12).all(), observed
    # the attention and MLP branches of a block, and different blocks, decide independently
    a, m = keep[-1, 0], keep[-1, 1]
    both = (a * m).mean().item()
    assert abs(both - (1 - rates[-1].item()) ** 2) < 4 * (0.25 / 20000) ** 0.5


def test_a_samples_decisions_do_not_depend_on_its_batch():
    """The same seed gives the same masks whatever the batch holds and in whatever order: the run is the same at any
    world size and micro-batch."""
    model = create_model("convit_nano", num_classes=10, drop_path_rate=0.5)
    seeds = torch.arange(64, dtype=torch.int64) * 104729
    whole = model.drop_path_keep(seeds)
    perm = torch.randperm(64, generator=torch.Generator().manual_seed(0))
    assert torch.equal(model.drop_path_keep(seeds[perm]), whole[:, :, perm])
    assert torch.equal(model.drop_path_keep(seeds[10:13]), whole[:, :, 10:13])
    assert torch.equal(model.drop_path_keep(seeds[5:6]), whole[:, :, 5:6])
    assert create_model("convit_nano", num_classes=10, drop_path_rate=0.0).drop_path_keep(seeds) is None


def test_seeded_drop_path_applies_timms_rule():
    """With the same 0/1 mask, the output is timm's DropPath: kept samples scaled by 1 / (1 - p), dropped ones 0;
    in evaluation both are the identity."""
    x = torch.randn(6, 5, 4)
    keep = torch.tensor([1.0, 0.0, 1.0, 1.0, 0.0, 1.0])
    ours = SeededDropPath(0.25).train()
    expected = x * (keep / 0.75).view(-1, 1, 1)
    assert torch.equal(ours(x, keep), expected)
    timm = DropPath(0.25).train()
    torch.manual_seed(0)
    theirs = timm(x)
    torch.manual_seed(0)
    assert torch.equal(ours(x), theirs)  # without decisions: timm's own draw from the global generator
    assert torch.equal(ours.eval()(x, keep), x) and torch.equal(timm.eval()(x), x)


def test_seeded_scaling_is_timms_for_timms_own_mask():
    """timm's DropPath draws a mask; given that mask as decisions, SeededDropPath returns timm's output bit for bit
    (kept samples scaled by 1 / keep_prob in x's dtype, dropped ones 0)."""
    x = torch.randn(32, 5, 4) + 3.0  # no zero samples, so a sample's decision can be read from timm's output
    torch.manual_seed(1)
    theirs = DropPath(0.3).train()(x)
    mask = (theirs.flatten(1) != 0).all(dim=1).to(torch.float32)
    assert 0 < mask.sum() < 32  # both decisions occur
    assert torch.equal(SeededDropPath(0.3).train()(x, mask), theirs)


def test_a_samples_output_does_not_depend_on_its_batch():
    """Through the whole model in training: a sample gives the same logits at another place of another batch (its
    drop-path decisions travel with its seed), and the decisions matter (another seed gives other logits)."""
    torch.manual_seed(0)
    model = create_model("convit_nano", num_classes=10, drop_path_rate=0.5).train()
    images, seeds = torch.randn(12, 3, 16, 16), torch.arange(12, dtype=torch.int64) * 7 + 11
    first = model(images[:6], drop_path_keep=model.drop_path_keep(seeds[:6]))
    order = torch.tensor([9, 3, 7, 0, 11])  # sample 3 at place 1 among other samples
    second = model(images[order], drop_path_keep=model.drop_path_keep(seeds[order]))
    torch.testing.assert_close(second[1], first[3], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(second[3], first[0], rtol=1e-5, atol=1e-6)
    others = model(images[:6], drop_path_keep=model.drop_path_keep(seeds[:6] + 1000))
    assert not torch.allclose(others, first, rtol=1e-3, atol=1e-4)


def test_evaluation_drops_nothing():
    """In evaluation the decisions are ignored: every branch kept, unscaled, whatever the seeds say."""
    torch.manual_seed(0)
    model = create_model("convit_nano", num_classes=10, drop_path_rate=0.5).eval()
    images = torch.randn(4, 3, 16, 16)
    keep = model.drop_path_keep(torch.arange(4, dtype=torch.int64))
    assert (keep == 0).any()
    with torch.no_grad():
        plain = model(images)
        assert torch.equal(model(images, drop_path_keep=keep), plain)
        assert torch.equal(model(images, drop_path_keep=torch.zeros_like(keep)), plain)
    model.train()  # the same decisions in training do change the output
    with torch.no_grad():
        assert not torch.allclose(model(images, drop_path_keep=keep), plain, rtol=1e-3, atol=1e-4)
