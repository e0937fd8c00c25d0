"""Fault injection and debug measurements, installed at set-up when asked and absent from the step otherwise.

- ``CONVIT_SCALE_NAN_AT_STEP=s[:m][,...]``: rank 0's loss of step ``s`` (micro-batch ``m``, default 0) becomes
  NaN (tests of the non-finite policy).
- ``CONVIT_SCALE_INF_GRAD_AT_STEP=s[:m][,...]``: rank 0's loss stays finite but its gradient becomes inf.
- ``CONVIT_SCALE_KILL_AT_STEP=s:r[,...]``: rank ``r`` kills itself (SIGKILL, as the OOM killer or a GPU error ends
  a process) when step ``s`` begins; ``CONVIT_SCALE_STOP_AT_STEP=s:r``: it stops itself (SIGSTOP: a hang);
  ``CONVIT_SCALE_STOP_WORKER_AT_STEP=s:r``: it stops its DataLoader workers (a loader that never delivers);
  ``CONVIT_SCALE_SIGNAL_AT_STEP=s:r``: it sends itself SIGTERM (a preemption, at a known step). Every start of the
  run that reaches step ``s`` suffers it again (tests of the launcher's same-failure-twice rule).
  ``CONVIT_SCALE_SIGNAL_IN_EVAL=e:r``: rank ``r`` sends itself SIGTERM as the evaluation of epoch ``e`` begins;
  ``CONVIT_SCALE_SIGNAL_AT_EPOCH_END=e:r``: as epoch ``e`` closes, before its evaluation.
- ``CONVIT_SCALE_STEP_DELAY_S=x``: every rank waits ``x`` s before each step (a fault test on a fast CPU, whose
  tiny steps take milliseconds, gets time to hit a run in the middle of an epoch from outside).
- ``log.debug_memory``: the memory of live tensors after backward, once (``state_mem_mb``; memory.py).
- ``log.debug_digest``: a digest of this rank's weights and optimizer state after every step (``state_digest``),
  and the teacher's checksums at start and end.
The environment is read once, here, when the run is set up.
"""

from __future__ import annotations

import hashlib
import os
import signal
import time
from dataclasses import dataclass, field

import torch

from .watchdog import child_states


class _InfGradient(torch.autograd.Function):
    """Identity forward; backward sends an infinite gradient (a finite loss whose gradients overflow)."""

    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return grad * float("inf")


def _marks(var: str) -> set[tuple[int, int]]:
    marks = set()
    for item in filter(None, os.environ.get(var, "").split(",")):
        step, _, micro = item.partition(":")
        marks.add((int(step), int(micro or 0)))
    return marks


def _process_faults(rank: int) -> dict[int, str]:
    """{step: "kill" | "stop" | "stop_worker" | "signal"} of this rank from the environment."""
    found = {}
    for var, what in (("CONVIT_SCALE_KILL_AT_STEP", "kill"), ("CONVIT_SCALE_STOP_AT_STEP", "stop"),
                      ("CONVIT_SCALE_STOP_WORKER_AT_STEP", "stop_worker"), ("CONVIT_SCALE_SIGNAL_AT_STEP", "signal")):
        found.update({step: what for step, r in _marks(var) if r == rank})
    return found


@dataclass
class Faults:
    """Where to corrupt rank 0's loss, and which step this rank dies or hangs in; empty (the normal case) costs one
    ``if`` per micro-batch."""

    nan_loss: set = field(default_factory=set)
    inf_grad: set = field(default_factory=set)
    process: dict = field(default_factory=dict)
    """{step: "kill" | "stop" | "stop_worker" | "signal"} of this rank."""
    delay_s: float = 0.0
    signal_in_eval: set = field(default_factory=set)
    """Epochs whose evaluation this rank receives SIGTERM in."""
    signal_at_close: set = field(default_factory=set)
    """Epochs whose close (before the evaluation) this rank receives SIGTERM at."""

    @classmethod
    def from_env(cls, rank: int) -> "Faults | None":
        f = cls(*((_marks("CONVIT_SCALE_NAN_AT_STEP"), _marks("CONVIT_SCALE_INF_GRAD_AT_STEP")) if rank == 0
                  else (set(), set())), _process_faults(rank), float(os.environ.get("CONVIT_SCALE_STEP_DELAY_S", 0)),
                {e for e, r in _marks("CONVIT_SCALE_SIGNAL_IN_EVAL") if r == rank},
                {e for e, r in _marks("CONVIT_SCALE_SIGNAL_AT_EPOCH_END") if r == rank})
        return f if (f.nan_loss or f.inf_grad or f.process or f.delay_s or f.signal_in_eval
                     or f.signal_at_close) else None

    def before_eval(self, epoch: int) -> None:
        """The evaluation of ``epoch`` begins: a stop signal where asked."""
        if epoch in self.signal_in_eval:
            os.kill(os.getpid(), signal.SIGTERM)

    def before_close(self, epoch: int) -> None:
        """Epoch ``epoch`` closes (its last step done, its evaluation not begun): a stop signal where asked."""
        if epoch in self.signal_at_close:
            os.kill(os.getpid(), signal.SIGTERM)

    def before_step(self, step: int) -> None:
        """Step ``step`` begins: wait, kill or stop this process, or stop its loader workers, where asked."""
        if self.delay_s:
            time.sleep(self.delay_s)
        what = self.process.get(step)
        if what == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        elif what == "stop":
            os.kill(os.getpid(), signal.SIGSTOP)
        elif what == "signal":
            os.kill(os.getpid(), signal.SIGTERM)
        elif what == "stop_worker":
            for child in child_states():
                os.kill(child["pid"], signal.SIGSTOP)

    def apply(self, loss: torch.Tensor, step: int, micro: int) -> torch.Tensor:
        if (step, micro) in self.nan_loss:
            return loss * float("nan")
        if (step, micro) in self.inf_grad:
            return _InfGradient.apply(loss)
        return loss


def state_digest(tensors: list[torch.Tensor]) -> str:
    """SHA-1 over the bytes of ``tensors`` in order: equal digests mean bit-identical state."""
    h = hashlib.sha1()
    for t in tensors:
        h.update(t.detach().reshape(-1).contiguous().cpu().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def checksum(module: torch.nn.Module) -> float:
    return float(sum(p.detach().double().sum().item() + p.detach().double().abs().sum().item()
                     for p in module.parameters()))
