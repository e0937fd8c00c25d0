"""Fault injection and debug measurements (convit_scale/train/debug.py): the environment read once into ``Faults``
(rank 0's loss made NaN or its gradient inf at the marked step and micro-batch, a rank's own death or hang), nothing
installed when nothing is asked, and the state digest equal exactly for bit-identical state."""

from __future__ import annotations

import math
import time

import torch

from convit_scale.train.debug import Faults, checksum, state_digest


def test_the_environment_marks_steps_and_micro_batches_of_rank_0s_loss(monkeypatch):
    for var in ("NAN", "INF_GRAD", "KILL", "STOP", "STOP_WORKER"):
        monkeypatch.delenv(f"CONVIT_SCALE_{var}_AT_STEP", raising=False)
    monkeypatch.delenv("CONVIT_SCALE_STEP_DELAY_S", raising=False)
    assert Faults.from_env(0) is None  # nothing asked: nothing installed, the step runs as it is
    monkeypatch.setenv("CONVIT_SCALE_STEP_DELAY_S", "0.2")
    slow = Faults.from_env(1)
    t0 = time.monotonic()
    slow.before_step(1)
    assert slow.delay_s == 0.2 and time.monotonic() - t0 >= 0.2 and slow.process == {}
    monkeypatch.delenv("CONVIT_SCALE_STEP_DELAY_S")
    monkeypatch.setenv("CONVIT_SCALE_NAN_AT_STEP", "3,5:1")
    monkeypatch.setenv("CONVIT_SCALE_INF_GRAD_AT_STEP", "4")
    monkeypatch.setenv("CONVIT_SCALE_KILL_AT_STEP", "7:1")
    monkeypatch.setenv("CONVIT_SCALE_STOP_WORKER_AT_STEP", "9:0")
    f = Faults.from_env(0)
    assert f.nan_loss == {(3, 0), (5, 1)} and f.inf_grad == {(4, 0)} and f.process == {9: "stop_worker"}
    other = Faults.from_env(1)  # the loss faults are rank 0's; the kill is rank 1's
    assert other.nan_loss == set() and other.inf_grad == set() and other.process == {7: "kill"}

    w = torch.tensor(2.0, requires_grad=True)
    assert math.isnan(f.apply(w * 3, 3, 0).item()) and f.apply(w * 3, 5, 0).item() == 6.0
    loss = f.apply(w * 3, 4, 0)
    assert loss.item() == 6.0  # finite loss, infinite gradient
    loss.backward()
    assert math.isinf(w.grad.item())
    f.before_step(8)  # no fault marked at this step: nothing happens to this process


def test_the_digest_is_equal_only_for_bit_identical_state():
    a = [torch.arange(6, dtype=torch.float32).reshape(2, 3), torch.tensor([1, 2], dtype=torch.int64)]
    assert state_digest(a) == state_digest([t.clone() for t in a])
    assert state_digest(a) != state_digest([a[0], a[1] + 1])
    assert state_digest([torch.tensor([0.0])]) != state_digest([torch.tensor([-0.0])])  # bits, not values
    assert state_digest(a) != state_digest(a[::-1])
    model = torch.nn.Linear(2, 1)
    with torch.no_grad():
        model.weight.copy_(torch.tensor([[1.0, -2.0]]))
        model.bias.fill_(0.5)
    assert checksum(model) == (1 - 2 + 0.5) + (1 + 2 + 0.5)  # sum and sum of magnitudes, over the parameters
