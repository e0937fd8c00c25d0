"""A dry run's figures as data (``summary``: what ``plan --dry-run --json`` prints) beside the planner's model of the
same layout."""

from __future__ import annotations

from collections import Counter

from ..planner import Layout, plan
from .census import Census

MARGIN = 0.25
"""The measured peak and the planner's model agree when they differ by at most this fraction of the measured peak."""
TRUST = ("the measured peak: it is the live tensors of the recipe's own step (the strategy's real buffers, "
         "buckets and gathered blocks at this world size and micro-batch), where the planner's model is a formula per "
         "parameter and per image calibrated on CPU runs; neither counts the CUDA context, NCCL's buffers or the "
         "allocator's fragmentation, for which the planner keeps 1 GiB and 10% of the GPU")
WARMUP_STEPS = 2
"""Steps left out of the per-step census: the first (lazy set-up, the device constants) and the second, where DDP
rebuilds its gradient buckets once (a pageable copy and a blocking read)."""
DEEPSPEED_WAITS = {
    "zero1": [("torch.cuda.synchronize", "deepspeed/runtime/zero/stage_1_and_2.py: "
               "independent_gradient_partition_epilogue", 1.0)],
    "zero2": [("torch.cuda.synchronize", "deepspeed/runtime/zero/stage_1_and_2.py: "
               "independent_gradient_partition_epilogue", 1.0)],
    "zero3": [("torch.cuda.Stream.synchronize", "deepspeed/runtime/zero/stage3.py: "
               "independent_gradient_partition_epilogue", 1.0),
              ("a host read of a device value (.item(), bool(), .tolist(), float())",
               "deepspeed/runtime/utils.py: is_invalid_grad_norm", 1.0),
              ("torch.cuda.synchronize", "deepspeed/runtime/zero/partition_parameters.py: "
               "_allgather_params_coalesced", 1.0)],
}
"""The host waits per step DeepSpeed 0.19.8 keeps whatever the project's settings (docs/gpu.md), beside the step's own
read, as (what, origin, per step): ZeRO-1/2 synchronise the device at the end of backward (the gradient reduction's
epilogue); ZeRO-3 synchronises its reduction stream there, reads whether the norm is finite on the host and
synchronises when it gathers parameters for the step. Measured by ``plan --dry-run`` (tests/test_dryrun.py)."""
KINDS = {"host wait": "host_waits", "pageable copy": "pageable_copies", "cpu collective": "cpu_collectives"}
"""The census's kinds and their keys in the summary."""


def _rows(census: Census, kind: str, phases: set[str], per: int = 1) -> list[dict]:
    found = Counter((e.what, e.frame, e.origin) for e in census.events if e.kind == kind and e.phase in phases)
    return [{"count": n / per, "what": what, "frame": frame, "origin": origin,
             "owner": "deepspeed" if origin.startswith("deepspeed/") else "project" if frame != "-" else "library"}
            for (what, frame, origin), n in sorted(found.items(), key=lambda kv: -kv[1])]


def measured_steps(steps: int) -> list[int]:
    return list(range(WARMUP_STEPS + 1, steps + 1))


def census_summary(census: Census, steps: int) -> dict:
    """Per kind: the events per step after the warm-up (``per_step``) and the others (``once``: set-up, warm-up,
    evaluation), each with its project frame and its origin."""
    measured = {f"step {s}" for s in measured_steps(steps)}
    other = {e.phase for e in census.events} - measured
    out = {}
    for kind in KINDS:
        rows = _rows(census, kind, measured, max(len(measured), 1))
        out[kind] = {"per_step": sum(r["count"] for r in rows), "each": rows, "once": _rows(census, kind, other)}
    for kind in KINDS:
        for row in out[kind]["once"]:
            row["phases"] = sorted({e.phase for e in census.events if e.kind == kind and e.what == row["what"]
                                    and e.frame == row["frame"] and e.origin == row["origin"] and e.phase in other})
    return out


def model_row(cfg, nodes: int, gpus_per_node: int, gpu: str) -> dict:
    """The planner's row of the recipe's own layout on this job (its memory per GPU)."""
    own = Layout.of(cfg.parallel, nodes * gpus_per_node, gpus_per_node)
    return plan(cfg, nodes, gpus_per_node, gpu, layouts=[own])[0]


def summary(result: dict, cfg, gpu: str) -> dict:
    """The dry run's figures and the planner's, as data."""
    row = model_row(cfg, result["nodes"], result["gpus_per_node"], gpu)
    peak = None if result["peak_bytes"] is None else result["peak_bytes"] / 2**30
    model = row["total_gib"]
    diff = None if not peak else (model - peak) / peak
    trusted = None if diff is None else ("agree" if abs(diff) <= MARGIN else "measured")
    return {
        "recipe": cfg.model.name, "layout": row["layout"], "strategy": result["strategy"],
        "world_size": result["world_size"], "nodes": result["nodes"], "gpus_per_node": result["gpus_per_node"],
        "steps": result["steps"], "measured_steps": measured_steps(result["steps"]),
        "peak_gib": peak, "model_gib": model, "model_micro_batch": row["micro_batch"],
        "difference": diff, "margin": MARGIN, "trusted": trusted,
        "why": None if trusted in (None, "agree") else TRUST,
        "device_mismatch": result["mismatch"],
        **{KINDS[k]: v for k, v in census_summary(result["census"], result["steps"]).items()},
    }
