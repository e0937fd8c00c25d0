"""What every benchmark shares: the subprocess that measures one candidate, and the timed training step.

Each candidate runs in a fresh ``python -m convit_scale.bench KIND SPEC`` (peak memory is then its own);
``timed_step`` is the one measurement of a model's step: build, warm up, time, peak memory.
"""

from __future__ import annotations

import json
import os
import resource
import subprocess
import sys
import time
from typing import Callable, NamedTuple

import torch
from torch import nn


class Workload(NamedTuple):
    """What a benchmark times: a model, the optimizer stepping it (None: gradients are kept, as in
    accumulation) and the loss of (images, logits, labels) (None: cross-entropy)."""

    model: nn.Module
    optimizer: torch.optim.Optimizer | None = None
    loss: Callable | None = None


RSS_ENV = {"MALLOC_MMAP_THRESHOLD_": "1048576"}
"""For a worker whose peak RSS is read: glibc's malloc then maps every block of 1 MiB or more on its own and unmaps it
when freed, so the peak is the workload's and not the heap's high-water mark. Only for those: every large block then
page-faults afresh when used, which training does not pay (a batch of 64 uint8 crops copied out of a loader: 2,353
faults, and the unmap interrupts threads on the other cores), so times measured under it are not training's (PIL's
JPEG decode ran at half speed, timm's ConViT step lost more than ours)."""


def worker_env(memory: bool) -> dict:
    """The environment of a worker: training's, or with ``RSS_ENV`` when its peak memory is what is read."""
    return {**os.environ, **(RSS_ENV if memory else {})}


def run_worker(kind: str, spec: dict, memory: bool = False, env: dict | None = None) -> dict:
    """One measurement in a fresh interpreter; its last stdout line is the JSON result. ``memory``: the result's peak
    memory is read (the worker runs with ``RSS_ENV``); otherwise its times are, and it runs with training's malloc.
    ``env``: variables set for the worker beside those."""
    env = {**worker_env(memory), **(env or {})}
    out = subprocess.run([sys.executable, "-m", "convit_scale.bench", kind, json.dumps(spec)], capture_output=True,
                         text=True, env=env)
    if out.returncode != 0:
        raise RuntimeError(f"benchmark worker {kind} failed: {out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def timed(step, n: int, device: torch.device) -> float:
    """Seconds for ``n`` calls of ``step``, with the device's queue drained before and after."""
    if device.type == "cuda":
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(n):
        step()
    if device.type == "cuda":
        torch.cuda.synchronize()
    return time.perf_counter() - t0


def _memory_now(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.memory_allocated(device)
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _peak_bytes(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device)
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def train_step(w: Workload, x: torch.Tensor, y: torch.Tensor, precision: str):
    """The closure of one training step: forward (autocast in bf16), loss, backward, optimizer step."""
    dtype = torch.bfloat16 if precision == "bf16" else None
    loss_fn = w.loss or (lambda images, logits, labels: nn.functional.cross_entropy(logits.float(), labels))

    def step():
        with torch.autocast(x.device.type, dtype=dtype, enabled=dtype is not None):
            loss = loss_fn(x, w.model(x), y)
        loss.backward()
        if w.optimizer is not None:
            w.optimizer.step()
            w.optimizer.zero_grad(set_to_none=True)
        else:
            w.model.zero_grad(set_to_none=False)  # keep gradient memory allocated, as in training

    return step


def timed_step(spec: dict, build: Callable[[dict, torch.device], Workload]) -> dict:
    """Images/s of ``spec["steps"]`` training steps after ``spec["warmup"]`` untimed ones, on a random batch
    of ``spec["batch"]`` images of ``spec["img_size"]`` pixels, and the peak memory of the timed steps above
    what the process held before ``build`` made the model (CUDA: allocated tensors; CPU: RSS, whose peak
    cannot be reset, so the warm-up counts too)."""
    device = torch.device(spec["device"])
    torch.manual_seed(0)
    size = spec["img_size"]
    x = torch.randn(spec["batch"], 3, size, size, device=device)
    y = torch.randint(0, 1000, (spec["batch"],), device=device)
    base = _memory_now(device)
    step = train_step(build(spec, device), x, y, spec.get("precision", "fp32"))
    for _ in range(spec["warmup"]):
        step()
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    seconds = timed(step, spec["steps"], device)
    return {"images_per_s": spec["batch"] * spec["steps"] / seconds, "peak_mb": (_peak_bytes(device) - base) / 2**20}
