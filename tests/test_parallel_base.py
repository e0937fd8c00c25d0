"""parallel/base.py: the gradient norm and clipping every strategy shares, against torch's own
``clip_grad_norm_`` (the rule the paper's recipe, DeiT's, uses)."""

from __future__ import annotations

import math

import torch

from convit_scale.parallel.base import clip_, local_grads, square_sum

CPU = torch.device("cpu")


def _grads(seed: int = 0, scale: float = 1.0) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(shape, generator=g) * scale for shape in ((3, 4), (5,), (2, 2, 2))]


def test_square_sum_is_the_squared_global_norm_in_float64():
    grads = _grads()
    want = sum(float((t.double() ** 2).sum()) for t in grads)
    got = square_sum(grads, CPU)
    assert got.dtype == torch.float64 and math.isclose(float(got), want, rel_tol=1e-6)
    assert float(square_sum([], CPU)) == 0.0
    half = [t.half() for t in grads]  # accumulated in float32 when asked: the same sum within half's rounding
    assert math.isclose(float(square_sum(half, CPU, torch.float32)), want, rel_tol=1e-2)


def test_clip_is_torchs_clip_grad_norm_with_the_norm_known():
    for scale, limit in ((10.0, 1.0), (0.01, 1.0)):  # above the limit: scaled; below: untouched
        ours, params = _grads(1, scale), [torch.nn.Parameter(t.clone()) for t in _grads(1, scale)]
        for p, t in zip(params, _grads(1, scale)):
            p.grad = t.clone()
        norm = float(torch.nn.utils.clip_grad_norm_(params, limit))
        clip_(ours, limit, norm)
        for a, p in zip(ours, params):
            torch.testing.assert_close(a, p.grad, rtol=1e-6, atol=0)
    for norm in (None, float("nan"), float("inf")):  # a bad step's norm, or no clipping: nothing is scaled
        grads = _grads(2, 10.0)
        clip_(grads, 1.0, norm)
        assert all(torch.equal(a, b) for a, b in zip(grads, _grads(2, 10.0)))
    grads = _grads(2, 10.0)
    clip_(grads, None, 5.0)
    assert all(torch.equal(a, b) for a, b in zip(grads, _grads(2, 10.0)))


def test_local_grads_skip_parameters_without_a_gradient():
    a, b = torch.nn.Parameter(torch.ones(2)), torch.nn.Parameter(torch.ones(3))
    b.grad = torch.full((3,), 2.0)
    assert [g.tolist() for g in local_grads([a, b])] == [[2.0, 2.0, 2.0]]
