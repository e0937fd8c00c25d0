"""``convit-scale plan --dry-run``: the recipe's real training step on simulated GPUs at the plan's world size
(convit_scale/dryrun), its measured peak memory per rank beside the planner's model, and its census of host waits,
pageable copies, CPU tensors handed to collectives and device mismatches."""

from __future__ import annotations

import contextlib
import json
import sys


def run_dry(cfg, args, nodes: int, gpus: int) -> int:
    """Print the dry run of ``cfg`` on ``nodes`` x ``gpus`` (``--json``: as data); 1 where this torch cannot simulate
    GPUs or a device mismatch stopped the step."""
    from ..dryrun.native import simulation_problem

    args.steps = args.steps or 4
    problem = simulation_problem()  # before importing what needs it
    if problem is not None:
        print(f"error: plan --dry-run cannot simulate GPUs here: {problem}", file=sys.stderr)
        return 1
    from ..dryrun.report import summary
    from ..dryrun.run import dry_run

    if not args.json:
        print(f"dry run: {args.steps} step(s) and an evaluation of {cfg.model.name} ({cfg.parallel.strategy}) on "
              f"{nodes} x {gpus} simulated GPUs, in this process", flush=True)
    with contextlib.redirect_stdout(sys.stderr) if args.json else contextlib.nullcontext():  # the run's log lines
        result = summary(dry_run(cfg, nodes, gpus, steps=args.steps), cfg, args.gpu)
    if args.json:
        print(json.dumps(result, indent=2))
    else:
        _print(result, args.gpu)
    return 1 if result["device_mismatch"] else 0


def _size(gib: float) -> str:
    return f"{gib:.2f} GiB" if gib >= 1 else f"{gib * 1024:.1f} MiB"


def _frames(rows: list[dict], per: str) -> list[str]:
    return [f"  {r['count']:g}{per} {r['what']} at {r['frame']}"
            + ("" if r["origin"] == r["frame"] else f" ({r['origin']})") for r in rows]


def _print(r: dict, gpu: str) -> None:
    if r["device_mismatch"]:
        print(f"error: {r['device_mismatch']}")
        return
    steps = r["measured_steps"]
    window = f"steps {steps[0]}-{steps[-1]}" if steps else "no step after the warm-up (--steps 3 or more)"
    print(f"peak tensor memory per rank: {_size(r['peak_gib'])} measured, {_size(r['model_gib'])} in the planner's "
          f"model ({r['layout']} on {gpu}, micro-batch {r['model_micro_batch']})")
    if r["trusted"] == "agree":
        print(f"  they agree within {r['margin']:.0%}")
    else:
        print(f"  they differ by {r['difference']:+.0%} (margin {r['margin']:.0%}); this plan trusts {r['why']}")
    waits = r["host_waits"]
    print(f"host waits per step ({window}): {waits['per_step']:g}")
    for line, row in zip(_frames(waits["each"], " per step"), waits["each"]):
        print(line + ("  [DeepSpeed's own]" if row["owner"] == "deepspeed" else ""))
    for kind, label in (("pageable_copies", "pageable host-to-device copies"),
                        ("cpu_collectives", "CPU tensors handed to collectives")):
        rows = r[kind]
        print(f"{label} per step ({window}): {rows['per_step']:g}")
        print("\n".join(_frames(rows["each"], " per step")) or "  none")
        if rows["once"]:
            at: dict = {}
            for x in rows["once"]:
                at[x["frame"]] = at.get(x["frame"], 0) + x["count"]
            print(f"  and outside them ({', '.join(sorted({p for x in rows['once'] for p in x['phases']}))}): "
                  + "; ".join(f"{n:g} at {frame}" for frame, n in sorted(at.items(), key=lambda kv: -kv[1])))
    print("device mismatches: none")
