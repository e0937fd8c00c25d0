"""`bench gate`: what the ZeRO strategy's bad-step gate costs per step, beside what it replaced.

Per ZeRO stage, in a fresh process with a one-rank process group on the device (NCCL on a GPU), a real
``ZeroStrategy`` trains ``model`` for a few steps, then on that step's real gradients each candidate is timed alone,
repeated:
- ``hooks``: the gate it replaced, a hook per parameter run on every micro-batch's gradient as autograd makes it
  (``vector_norm`` in float32, to float64, square, add: four kernels per parameter), on tensors of the parameters'
  shapes and dtype;
- ``fused``: the gate now, one multi-tensor norm over the gradients DeepSpeed reduced into the rank's partition, once
  per step (``zero_engine.partition_square_sum``);
- ``deepspeed_check``: DeepSpeed's own ZeRO-1/2 overflow check (``has_overflow``: a kernel per gradient, an
  all-reduce and a host read), which the strategy turns off under bf16 where DeepSpeed has the switch.
The whole step's time is given beside them (the strategy's step, the gate and the host read of its reduction
included), so that the gate's share of a step is read from one run.
"""

from __future__ import annotations

import time

import torch

from .. import comm
from ..config import OptimConfig, ParallelConfig
from ..errors import BadInput
from ..models import create_model
from ..parallel import build_strategy
from ..parallel.zero_engine import partition_square_sum
from ..train.distributed import init_distributed
from ..train.optim import build_optimizer
from .worker import run_worker


def _ms(fn, repeat: int, device: torch.device) -> float:
    """Milliseconds per call of ``fn``, the device's queue drained before and after ``repeat`` calls."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    t0 = time.perf_counter()
    for _ in range(repeat):
        fn()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return (time.perf_counter() - t0) * 1e3 / repeat


def _hooks(params: list[torch.Tensor], device: torch.device):
    """The replaced gate's work for one micro-batch: its hook body on a gradient of each parameter's shape."""
    grads = [torch.randn(getattr(p, "ds_shape", p.shape), dtype=p.dtype, device=device) for p in params]  # ZeRO-3:
    # the parameter's full shape (its data is a partition there)
    total = torch.zeros((), dtype=torch.float64, device=device)

    def run():
        nonlocal total
        for g in grads:
            total += torch.linalg.vector_norm(g, dtype=torch.float32).double().square()

    return run


def _training_step(strategy, x: torch.Tensor, y: torch.Tensor):
    def step():
        loss = torch.nn.functional.cross_entropy(strategy.forward(x).float(), y)
        strategy.backward(loss, True, 1)
        comm.all_reduce(strategy.grad_square_sum()).item()  # the loop's decision read
        strategy.step(None)

    return step


def worker(spec: dict) -> dict:
    """One stage in this fresh process: the whole step, then each candidate on that step's gradients."""
    ctx = init_distributed("nccl" if spec["device"].startswith("cuda") else "gloo", 600)
    device, repeat = ctx.device, spec["repeat"]
    try:
        model = create_model(spec["model"], img_size=spec["img_size"], drop_path_rate=0.0)
        p = ParallelConfig(strategy=spec["strategy"], precision=spec["precision"])
        strategy = build_strategy(model, p, device, 1, None)
        strategy.setup(lambda m: build_optimizer(m, OptimConfig(), 1e-4, device), spec["batch"], 1)
        x = torch.randn(spec["batch"], 3, spec["img_size"], spec["img_size"], device=device)
        y = torch.randint(0, 1000, (spec["batch"],), device=device)
        step = _training_step(strategy, x, y)
        for _ in range(2):
            step()
        step_ms = _ms(step, spec["steps"], device)
        loss = torch.nn.functional.cross_entropy(strategy.forward(x).float(), y)
        strategy.backward(loss, True, 1)  # the gradients the candidates read, reduced into the partition
        params = [q for q in strategy.module.parameters() if q.requires_grad]
        row = {"tensors": len(params), "elements": sum(q.ds_numel if hasattr(q, "ds_numel") else q.numel()
                                                       for q in params), "step_ms": step_ms,
               "hooks_ms_per_micro_batch": _ms(_hooks(params, device), repeat, device),
               "fused_ms_per_step": _ms(lambda: partition_square_sum(strategy.optimizer, device), repeat, device)}
        check = getattr(strategy.optimizer, "has_overflow", None)
        if spec["strategy"] != "zero3" and check is not None:  # ZeRO-3 checks fp16 only
            row["deepspeed_check_ms_per_step"] = _ms(lambda: check(partition_gradients=True), repeat, device)
            # off when the strategy turned it off (bf16, a release with the switch); fp32: never on
            row["deepspeed_check_was_on"] = getattr(strategy.optimizer, "check_grad_overflow", False) is not False
        strategy.skip_step()
        strategy.close()
        return row
    finally:
        comm.destroy()


def bench_gate(model: str, img_size: int, batch: int, steps: int, strategies: list[str], device: str,
               precision: str, repeat: int = 20) -> dict:
    """Per ZeRO stage: the whole step and each gate candidate (ms), and what the strategy saves per step of one
    micro-batch against the hooks (each further micro-batch ran the hooks again) and, under bf16 where it turned it
    off, DeepSpeed's own check."""
    bad = [s for s in strategies if s not in ("zero1", "zero2", "zero3")]
    if bad:
        raise BadInput(f"--strategies {','.join(bad)}: allowed: zero1, zero2, zero3 (the gate is ZeRO's)")
    rows = []
    for strategy in strategies:
        r = run_worker("gate", {"model": model, "img_size": img_size, "batch": batch, "steps": steps,
                                "strategy": strategy, "precision": precision, "device": device, "repeat": repeat})
        saved = r["hooks_ms_per_micro_batch"] - r["fused_ms_per_step"]  # one micro-batch a step (more: more hooks)
        if precision == "bf16" and not r.get("deepspeed_check_was_on", True):
            saved += r["deepspeed_check_ms_per_step"]  # what DeepSpeed's release ran before the switch was set
        rows.append({"strategy": strategy, **r, "saved_ms_per_step": saved,
                     "saved_fraction_of_step": saved / r["step_ms"]})
    return {"model": model, "img_size": img_size, "batch": batch, "steps": steps, "device": device,
            "precision": precision, "repeat": repeat, "rows": rows}
