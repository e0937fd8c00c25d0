"""``parallel.strategy = none`` (convit_scale/parallel/single.py), the plain module trained by one process: its
micro-batches average into the step's gradient, the squared norm it reports, the clipped update, a skipped step
that changes nothing, fp16 through a loss scaler whose gradients it unscales. DDP, which extends it:
tests/test_parallel_ddp.py."""

from __future__ import annotations

import copy

import pytest
import torch
from support import built_strategy

from convit_scale.parallel.single import SingleProcessStrategy

CPU = torch.device("cpu")


def _batch(seed: int, n: int = 4):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, 3, 16, 16, generator=g), torch.randint(0, 10, (n,), generator=g)


def _loss(model_or_strategy, seed: int):
    x, y = _batch(seed)
    out = model_or_strategy.forward(x) if hasattr(model_or_strategy, "wrapped") else model_or_strategy(x)
    return torch.nn.functional.cross_entropy(out.float(), y)


def _grads(module) -> dict[str, torch.Tensor]:
    return {n: p.grad.clone() for n, p in module.named_parameters() if p.grad is not None}


def test_the_module_itself_is_trained_in_the_recipes_precision():
    s = built_strategy(CPU, "parallel.strategy=none", "parallel.precision=fp32")
    assert type(s) is SingleProcessStrategy and s.wrapped is s.module and s.scaler is None and not s.scales_loss
    assert {id(p) for g in s.optimizer.param_groups for p in g["params"]} == {id(p) for p in s.module.parameters()}
    assert s.forward(_batch(0)[0]).dtype == torch.float32
    s = built_strategy(CPU, "parallel.strategy=none", "parallel.precision=bf16",
                       "parallel.activation_checkpointing=true")
    assert s.forward(_batch(0)[0]).dtype == torch.bfloat16  # autocast; the parameters stay fp32
    assert all(p.dtype == torch.float32 for p in s.module.parameters()) and s.module.grad_checkpointing


def test_micro_batches_average_into_the_steps_gradient_and_its_squared_norm():
    s = built_strategy(CPU, "parallel.strategy=none", "parallel.precision=fp32")
    s.train(False)  # no drop-path: the reference below draws nothing either
    reference = copy.deepcopy(s.module)
    for m in range(2):
        s.backward(_loss(s, m), is_last_micro=m == 1, grad_accum=2)
    ((_loss(reference, 0) + _loss(reference, 1)) / 2).backward()
    got, want = _grads(s.module), _grads(reference)
    assert got.keys() == want.keys() and len(got) > 10
    for n in want:
        torch.testing.assert_close(got[n], want[n], rtol=1e-5, atol=1e-7)
    norm2 = s.grad_square_sum()
    assert norm2.dtype == torch.float64 and norm2.shape == ()
    assert float(norm2) == pytest.approx(sum(float((g.double() ** 2).sum()) for g in want.values()),
                                                     rel=1e-5)


def test_a_good_step_clips_and_updates_a_bad_one_changes_nothing(monkeypatch):
    s = built_strategy(CPU, "parallel.strategy=none", "parallel.precision=fp32")
    s.train(False)
    before = copy.deepcopy(s.module.state_dict())
    s.backward(_loss(s, 0), True, 1)
    s.skip_step()  # a bad step: the gradients go, the weights and the optimizer's state stay
    assert all(p.grad is None for p in s.module.parameters()) and not s.optimizer.state
    assert all(torch.equal(v, before[k]) for k, v in s.module.state_dict().items())

    s.grad_clip = 0.01
    s.backward(_loss(s, 0), True, 1)
    norm = float(s.grad_square_sum()) ** 0.5
    assert norm > 0.1  # far above the limit: the step scales the gradients down to it
    seen = []
    step = s.optimizer.step
    monkeypatch.setattr(s.optimizer, "step", lambda: seen.append(
        sum(float((p.grad.double() ** 2).sum()) for p in s.module.parameters() if p.grad is not None) ** 0.5)
        or step())
    s.step(norm)
    assert seen == [pytest.approx(0.01, rel=1e-4)]
    assert all(p.grad is None for p in s.module.parameters()) and s.optimizer.state
    assert any(not torch.equal(v, before[k]) for k, v in s.module.state_dict().items())


def test_fp16_skips_the_overflowing_steps_and_reports_the_unscaled_norm():
    """fp16 through torch's GradScaler: a step whose scaled gradients overflow (the first ones, at a scale of 2**16)
    reports a non-finite norm and leaves the weights as they were while the scale halves; the first finite norm is
    the gradient's own (unscaled), and its step updates the weights."""
    s = built_strategy(CPU, "parallel.strategy=none", "parallel.precision=fp16")
    s.train(False)
    assert s.scaler is not None and s.scales_loss and s.forward(_batch(0)[0]).dtype == torch.float16
    reference = copy.deepcopy(s.module)
    with torch.autocast("cpu", dtype=torch.float16):
        _loss(reference, 0).backward()
    want = sum(float((g.double() ** 2).sum()) for g in _grads(reference).values())
    before = copy.deepcopy(s.module.state_dict())
    for _ in range(24):
        scale = s.scaler.get_scale()
        s.backward(_loss(s, 0), True, 1)
        norm2 = float(s.grad_square_sum())  # unscales the gradients first
        s.step(norm2 ** 0.5)
        if norm2 != float("inf"):
            break
        assert s.scaler.get_scale() == scale / 2
        assert all(torch.equal(v, before[k]) for k, v in s.module.state_dict().items())
    assert norm2 == pytest.approx(want, rel=1e-2) and scale < 2.0 ** 16
    assert any(not torch.equal(v, before[k]) for k, v in s.module.state_dict().items())
    assert all(p.grad is None for p in s.module.parameters())
