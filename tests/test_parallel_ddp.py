"""DDP (convit_scale/parallel/ddp.py) in a one-rank gloo group: the module behind DDP's wrapper (gradients in its
buckets, no buffer broadcast), the accumulation's micro-batches under ``no_sync`` with the gradient of the plain
module's, the squared norm counted once (rank 0's), and no wrapper without a process group. The 2-rank runs against
one process: tests/test_train_step.py, test_parallel_nonfinite.py; its checkpoints: test_parallel_dcp.py."""

from __future__ import annotations

import inspect

import pytest
import torch
from support import built_strategy, one_rank_group
from torch.nn.parallel import DistributedDataParallel as DDP

from convit_scale.parallel.ddp import NO_BUFFER_SYNC, DDPStrategy

CPU = torch.device("cpu")


def _loss(strategy, seed: int):
    g = torch.Generator().manual_seed(seed)
    x, y = torch.randn(4, 3, 16, 16, generator=g), torch.randint(0, 10, (4,), generator=g)
    return torch.nn.functional.cross_entropy(strategy.forward(x).float(), y)


def _grads(module) -> dict[str, torch.Tensor]:
    return {n: p.grad.clone() for n, p in module.named_parameters() if p.grad is not None}


def test_without_a_process_group_the_module_is_not_wrapped():
    s = built_strategy(CPU, "parallel.strategy=ddp", "parallel.precision=fp32")
    assert type(s) is DDPStrategy and s.wrapped is s.module
    assert type(s.micro_batch(False)).__name__ == "nullcontext"


def test_the_wrapper_keeps_gradients_in_its_buckets_and_broadcasts_no_buffers():
    (switch, value), = NO_BUFFER_SYNC.items()
    assert value is False and switch in inspect.signature(DDP).parameters
    with one_rank_group(CPU):
        s = built_strategy(CPU, "parallel.strategy=ddp", "parallel.precision=fp32")
        try:
            assert isinstance(s.wrapped, DDP) and s.wrapped.module is s.module
            assert s.wrapped.gradient_as_bucket_view and getattr(s.wrapped, switch) is False
            assert type(s.micro_batch(True)).__name__ == "nullcontext"
        finally:
            s.close()


def test_accumulated_micro_batches_give_the_plain_modules_gradient_counted_once(monkeypatch):
    """Two micro-batches, the first under no_sync (held over forward and backward, where DDP prepares its reducer):
    the gradient of the step's mean loss, as the one-process strategy computes it; the squared norm is rank 0's
    alone (every rank holds the same reduced gradients)."""
    plain = built_strategy(CPU, "parallel.strategy=none", "parallel.precision=fp32")
    plain.train(False)
    for m in range(2):
        plain.backward(_loss(plain, m), m == 1, 2)
    want, want_norm2 = _grads(plain.module), float(plain.grad_square_sum())
    with one_rank_group(CPU):
        s = built_strategy(CPU, "parallel.strategy=ddp", "parallel.precision=fp32")
        try:
            s.train(False)
            syncs = []
            for m in range(2):
                with s.micro_batch(m == 1):
                    syncs.append(s.wrapped.require_backward_grad_sync)
                    s.backward(_loss(s, m), m == 1, 2)
            assert syncs == [False, True]
            got = _grads(s.module)
            assert got.keys() == want.keys()
            for n in want:
                torch.testing.assert_close(got[n], want[n], rtol=1e-5, atol=1e-7)
            assert float(s.grad_square_sum()) == pytest.approx(want_norm2, rel=1e-5)
            monkeypatch.setattr("convit_scale.comm.rank", lambda: 1)
            other = s.grad_square_sum()
            assert other.dtype == torch.float64 and float(other) == 0.0
        finally:
            s.close()
