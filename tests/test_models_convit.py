"""The model (convit_scale/models/convit.py): GPSA (fast against reference, attention rows, relative positions, the
convolutional init, Table 3's switches), meta build then init, activation checkpointing; seeded drop-path: timm's
stochastic depth, decided per sample from its seed."""

from __future__ import annotations

import pytest
import torch
from timm.layers import DropPath

from convit_scale.models import MODELS, create_model, relative_positions
from convit_scale.models.convit import GPSA, SeededDropPath


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


def _grads(model):
    return {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("name", ["convit_micro", "convit_nano"])
def test_fast_gpsa_matches_reference_outputs_and_gradients(name):
    torch.manual_seed(0)
    model = create_model(name, num_classes=7, drop_path_rate=0.0)
    with torch.no_grad():  # move the gating away from its init so both terms matter
        for blk in model.gpsa_blocks():
            blk.attn.gating_param.uniform_(-2, 2)
    x = torch.randn(5, 3, MODELS[name].img_size, MODELS[name].img_size)
    outs, grads = {}, {}
    for impl in ("fast", "reference"):
        model.zero_grad()
        model.set_gpsa_impl(impl)
        outs[impl] = model(x)
        (outs[impl] ** 2).sum().backward()
        grads[impl] = _grads(model)
    assert torch.allclose(outs["fast"], outs["reference"], atol=1e-5, rtol=0)
    assert grads["fast"].keys() == grads["reference"].keys()
    for k in grads["fast"]:
        assert torch.allclose(grads["fast"][k], grads["reference"][k], atol=1e-5, rtol=1e-4), k


def test_gpsa_attention_rows_sum_to_one_and_mask_position_is_content_only():
    torch.manual_seed(0)
    attn = GPSA(dim=32, num_heads=4, grid_size=4)
    attn.init_weights()
    x = torch.randn(2, 16, 32)
    a = attn.attention_map(x)
    assert a.shape == (2, 4, 16, 16)
    assert torch.allclose(a.sum(-1), torch.ones(2, 4, 16), atol=1e-6)
    with torch.no_grad():
        attn.gating_param.fill_(-1e4)  # sigma = 0: content only
    q, k, _ = attn._qkv(x)
    content = ((q @ k.transpose(-2, -1)) * attn.scale).softmax(-1)
    assert torch.allclose(attn.attention_map(x), content, atol=1e-6)
    out_sigma0 = attn(x)
    with torch.no_grad():
        attn.gating_param.fill_(3.0)
    attn.mask = "position"  # Table 6 masking: content attention only, whatever the gating
    assert torch.allclose(attn.attention_map(x), content, atol=1e-6)
    assert torch.allclose(attn(x), out_sigma0, atol=1e-6)


def test_relative_positions_exact_and_fp32_after_bf16_cast():
    r = relative_positions(14)
    assert r.shape == (196, 196, 3)
    # patch 0 = (row 0, col 0), patch 15 = (row 1, col 1): dx = 1, dy = 1, d^2 = 2
    assert r[0, 15].tolist() == [1.0, 1.0, 2.0]
    assert r[:, :, 2].max().item() == 2 * 13**2  # 338 > 256: would round in bf16
    model = create_model("convit_tiny").to(torch.bfloat16)
    buf = model.blocks[0].attn.rel_indices
    assert buf.dtype == torch.float32 and torch.equal(buf, r)
    assert "blocks.0.attn.rel_indices" not in model.state_dict()  # non-persistent


def test_convolutional_init_matches_spec():
    model = create_model("convit_small")  # 9 heads: a 3x3 grid, centre 1
    attn = model.blocks[0].attn
    assert torch.equal(attn.v.weight, torch.eye(432))
    w = attn.pos_proj.weight
    for h1 in range(3):
        for h2 in range(3):
            assert w[h1 + 3 * h2].tolist() == [2.0 * (h2 - 1), 2.0 * (h1 - 1), -1.0]
    assert torch.equal(attn.gating_param, torch.ones(9))
    even = create_model("convit_tiny").blocks[0].attn.pos_proj.weight  # 4 heads: centre 0.5
    assert even[0].tolist() == [-1.0, -1.0, -1.0] and even[3].tolist() == [1.0, 1.0, -1.0]


def test_table3_switches():
    m = create_model("convit_nano", train_gating=False, conv_init=False)
    attn = m.blocks[0].attn
    assert not attn.gating_param.requires_grad and torch.equal(attn.gating_param, torch.zeros(4))
    assert not torch.equal(attn.v.weight, torch.eye(32))
    m = create_model("convit_nano", freeze_gpsa=True)
    for blk in m.gpsa_blocks():
        assert not any(p.requires_grad for p in blk.attn.parameters())
        assert all(p.requires_grad for p in blk.mlp.parameters())
    assert all(p.requires_grad for p in m.blocks[-1].parameters())


def test_meta_build_then_init_weights_equals_eager_build():
    torch.manual_seed(3)
    eager = create_model("convit_nano")
    meta = create_model("convit_nano", device="meta")
    meta.to_empty(device="cpu")
    torch.manual_seed(3)
    meta.init_weights()
    for (n, a), (_, b) in zip(eager.state_dict().items(), meta.state_dict().items()):
        assert torch.equal(a, b), n
    assert torch.equal(meta.blocks[0].attn.rel_indices, relative_positions(4))


def test_activation_checkpointing_gives_same_gradients():
    torch.manual_seed(0)
    model = create_model("convit_nano", num_classes=5)
    x = torch.randn(3, 3, 16, 16)
    model(x).sum().backward()
    ref = _grads(model)
    model.zero_grad()
    model.set_grad_checkpointing(True)
    model(x).sum().backward()
    for k, g in _grads(model).items():
        assert torch.allclose(g, ref[k], atol=1e-6), k
