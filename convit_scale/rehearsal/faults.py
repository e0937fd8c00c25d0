"""The rehearsal's unplanned failures (``--fault KIND``): the script's job at its real rank count suffers one fault
after it has saved a checkpoint, and must come back by itself (slurm/launch.sh: a new srun step, or a requeue onto
the nodes left) and finish with the per-step losses of the same job run without interruption.

- ``kill``: one rank SIGKILLed (the OOM killer, a GPU error); ``stop``: one rank SIGSTOPped (a hang: the other
  ranks' watchdogs end it); ``worker``: one rank's loader worker stopped (its own watchdog ends it); ``node``: the
  last node drained and its ranks killed (the job requeues onto the others).

For each: detection time, time from the fault to the first new step and the steps redone, from the run's
faults.jsonl and the records' times as the watch saw them.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import sys
import tempfile
import time
from pathlib import Path

from ..errors import BadInput
from ..runfolder import EXIT_BAD_INPUT, FAULTS, HEARTBEAT, checkpoints, complete_checkpoints
from ..train.watchdog import STALE_BEATS, child_states, read_beats
from .cluster import LocalSlurm
from .run import (
    ELASTIC_RTOL,
    REPO,
    STEPS_PER_EPOCH,
    JobFailed,
    Refused,
    Watch,
    _parser,
    _refuse_bad_input,
    layout,
    losses_differ,
    prepare_data,
    read_script,
    recipe_batch,
    run_uninterrupted,
    saves_beside_training,
    steps_and_losses,
    submit,
    write_recipe,
)
from .run import main as preemption

KINDS = ("kill", "stop", "worker", "node")
FAULT_SECTION = {"hang_timeout_s": 60, "heartbeat_s": 5, "collective_timeout_s": 120, "startup_timeout_s": 900,
                 "long_phase_timeout_s": 300}
"""The rehearsal's watchdog: a 60 s step timeout (detected well under 90 s), start-up room for 32 ranks on 2 cores."""
WORKER_STEP_DELAY_S = 6
"""Seconds added to each step of the loader worker's job: longer than a heartbeat period."""


def live_ranks(out: Path, heartbeat_s: float) -> dict[int, dict]:
    """The ranks of the run's newest start whose heartbeat is fresh (written within the watchdog's staleness window),
    by rank. Only these pids may be signalled: a heartbeat left by a rank of an earlier start (killed: it never
    wrote its last one) names a pid that may since belong to another process (pids wrap at pid_max, 32768 by
    default), and a stop or a kill sent to it would hit a stranger: a test runner, a Slurm daemon."""
    beats = read_beats(out / HEARTBEAT)
    if not beats:
        return {}
    newest, now = max(beats, key=lambda b: b.get("born", 0))["launch"], time.time()
    return {b["rank"]: b for b in beats if b["launch"] == newest and b["state"] == "running"
            and now - b["alive"] < STALE_BEATS * heartbeat_s}


def children(pid: int) -> list[int]:
    """The pids of a process's children (its DataLoader workers)."""
    return [c["pid"] for c in child_states(pid)]


def inject(kind: str, slurm, out: Path, world: int) -> dict:
    """The fault, on the last node's first rank (every rank of the last node for ``node``); returns what was hit."""
    beats = live_ranks(out, FAULT_SECTION["heartbeat_s"])
    victim = beats[world - 1]
    if kind == "node":
        slurm.run("scontrol", "update", f"NodeName={victim['node']}", "State=DRAIN", "Reason=rehearsal")
        hit = [b for b in beats.values() if b["node"] == victim["node"]]
        for b in hit:
            os.kill(b["pid"], signal.SIGKILL)
        return {"kind": "node_lost", "node": victim["node"], "ranks": sorted(b["rank"] for b in hit)}
    if kind == "worker":
        for pid in children(victim["pid"]):
            os.kill(pid, signal.SIGSTOP)
    else:
        os.kill(victim["pid"], signal.SIGKILL if kind == "kill" else signal.SIGSTOP)
    return {"kind": "crash" if kind == "kill" else "hang", "rank": victim["rank"], "node": victim["node"]}


def _ready(watch, out: Path, world: int, after_step: int) -> bool:
    """Step ``after_step`` logged, a checkpoint saved, and every rank training."""
    ckpts = complete_checkpoints(checkpoints(out))
    beats = live_ranks(out, FAULT_SECTION["heartbeat_s"])
    return (bool(ckpts) and any(r["step"] >= after_step for _, r in watch.train()) and len(beats) == world
            and all(b["started"] for b in beats.values()))


def _epoch_begun(out: Path, world: int) -> bool:
    """The last rank has made the first step of an epoch and its loader worker exists: the worker has made at most
    the batches it prefetches (2), so the epoch's last batch is still to come from it. Stopped later, it would only
    be left behind as the epoch ends (the DataLoader's shutdown gives up on it) and the next epoch's worker is new."""
    beat = live_ranks(out, FAULT_SECTION["heartbeat_s"]).get(world - 1)
    return bool(beat and beat["step"] % STEPS_PER_EPOCH == 1 and children(beat["pid"]))


def run_fault(slurm, shape, kind: str, recipe: Path, data: Path, out: Path, launcher: str, after_step: int) -> dict:
    """One job with one fault; returns its figures and what the run recorded. The loader worker's stop needs the
    victim at an epoch's first step, which a heartbeat (every 5 s) sees only when a step lasts longer: that job's
    steps are slowed by WORKER_STEP_DELAY_S on every rank (the losses do not change)."""

    log = out.parent / f"{out.name}.out"
    min_nodes = shape.nodes - 1 if kind == "node" else None
    env = {"CONVIT_SCALE_STEP_DELAY_S": str(WORKER_STEP_DELAY_S)} if kind == "worker" else None
    watch = Watch(slurm, submit(slurm, shape, recipe, data, out, log, launcher, min_nodes, env), out, recipe)
    watch.wait(lambda: _ready(watch, out, shape.world, after_step), f"step {after_step} and a checkpoint", 1800)
    if kind == "worker":
        watch.wait(lambda: _epoch_begun(out, shape.world), "the first step of an epoch", 1800)
    t0 = time.time()
    hit = inject(kind, slurm, out, shape.world)
    try:
        path = out / FAULTS
        watch.wait(lambda: path.is_file() and path.read_text().strip(), "the fault's record", 600)
        detected = time.time()
        watch.wait(lambda: any(t > detected for t, _ in watch.train()), "a new step", 1800)
        first_new = min(t for t, _ in watch.train() if t > detected)
        watch.wait(lambda: watch.state.get("JobState") == "COMPLETED", "the end", 1800)
    finally:
        if kind == "node":
            slurm.run("scontrol", "update", f"NodeName={hit['node']}", "State=RESUME")
    rec = json.loads(path.read_text().splitlines()[0])
    return {"injected": hit, "record": rec, "watch": watch, "log": log,
            "figures": {"fault_to_record_s": round(detected - t0, 1), "detect_s": rec.get("detect_s"),
                        "fault_to_first_new_step_s": round(first_new - t0, 1), "steps_redone": rec.get("steps_redone"),
                        "resumed_from": rec.get("resumed_from")}}


def check(kind: str, result: dict, baseline, rtol: float | None) -> dict[str, str | None]:
    """Each check's failure, or None when it holds."""

    rec, hit, watch = result["record"], result["injected"], result["watch"]
    named = (rec["kind"], rec.get("node")) == (hit["kind"], hit["node"]) and (
        kind == "node" or rec.get("rank") == hit["rank"])
    la, lb = steps_and_losses(watch), steps_and_losses(baseline)
    diff = losses_differ(la, lb, rec.get("resumed_from") or 0, rtol if kind == "node" else None)
    return {
        f"{kind}: the job finished by itself": None if watch.state.get("JobState") == "COMPLETED"
        else f"state {watch.state.get('JobState')}",
        f"{kind}: the record names the {hit['kind']} on {hit['node']}": None if named
        else f"recorded {rec['kind']} of rank {rec.get('rank')} on {rec.get('node')}, injected {hit}",
        f"{kind}: detected within the watchdog's 60 s + 30 s": None
        if kind not in ("stop", "worker") or result["figures"]["fault_to_record_s"] < 90
        else f"{result['figures']['fault_to_record_s']} s",
        f"{kind}: per-step losses equal the uninterrupted job's" + (" (within the elastic tolerance after the "
                                                                   "resume)" if kind == "node" else ""):
        None if diff is None else f"largest relative difference {diff}",
    }


def rehearse_faults(args, shape, parallel: dict) -> dict:
    """The uninterrupted job, then one job per fault kind, on a fresh local cluster; the JSON report."""


    kinds = KINDS if args.fault == "all" else (args.fault,)
    out = (REPO / args.out).resolve()
    t0 = time.time()
    batch = recipe_batch(shape)  # the node loss resumes on one node fewer: unequal shares where they do not divide
    data = prepare_data(out / "data", batch[0])
    extra = {"checkpoint": {"every_steps": 2, "keep_last": 4}, "fault": FAULT_SECTION,
             "data": {"num_workers": 1 if "worker" in kinds else 0}}
    recipe = write_recipe(out / "recipe.yaml", data, out / "uninterrupted", parallel, args.steps, batch, extra=extra,
                          async_save=saves_beside_training(shape))
    names = ["uninterrupted"] + [f"fault_{k}" for k in kinds]
    for name in names:
        shutil.rmtree(out / name, ignore_errors=True)
        (out / f"{name}.out").unlink(missing_ok=True)
    results, found = {}, {}
    with tempfile.TemporaryDirectory(prefix="rehearsal-slurm-") as root:
        slurm = LocalSlurm(Path(root), nodes=shape.nodes, cpus=shape.tasks_per_node, gpus=shape.tasks_per_node).start()
        try:
            baseline = run_uninterrupted(slurm, shape, recipe, data, out / "uninterrupted", args.launcher)
            for kind in kinds:
                r = run_fault(slurm, shape, kind, recipe, data, out / f"fault_{kind}", args.launcher, args.signal_at)
                found.update(check(kind, r, baseline, ELASTIC_RTOL[parallel.get("precision", "fp32")]))
                results[kind] = {"injected": r["injected"], "figures": r["figures"], "record": r["record"]}
        except JobFailed as e:
            logs = sorted(out.glob("*.out"), key=lambda p: p.stat().st_mtime)
            raise JobFailed(f"{e}\n{logs[-1].read_text()[-4000:] if logs else 'no job log'}") from e
        finally:
            slurm.stop()
    result = {"script": str(shape.script.relative_to(REPO)), "ranks": shape.world, "nodes": shape.nodes,
              "launcher": args.launcher, "parallel": parallel, "steps": args.steps, "fault": FAULT_SECTION,
              "faults": results, "checks": found, "wall_s": round(time.time() - t0, 1), "out": str(out)}
    (out / "faults.json").write_text(json.dumps(result, indent=1, default=str))
    return result


def report(result: dict) -> None:
    print(f"rehearsal of unplanned failures: {result['script']} as {result['nodes']} nodes, {result['ranks']} ranks "
          f"({result['launcher']}), {result['steps']} steps, {result['wall_s']:.0f} s")
    for name, failure in result["checks"].items():
        print(f"  {'ok  ' if failure is None else 'FAIL'} {name}" + ("" if failure is None else f": {failure}"))
    for kind, r in result["faults"].items():
        f = r["figures"]
        print(f"  {kind}: fault -> record {f['fault_to_record_s']} s (detected after {f['detect_s']} s), fault -> "
              f"first new step {f['fault_to_first_new_step_s']} s, {f['steps_redone']} step(s) redone from checkpoint "
              f"step {f['resumed_from']}")
    print(f"  written to {result['out']}/faults.json")


def main(argv: list[str] | None = None) -> int:
    """``python -m convit_scale.rehearsal``: the preemption rehearsal (run.py), or with ``--fault`` this one."""

    parser = _parser()
    parser.add_argument("--fault", default="none", choices=("none", "all", *KINDS),
                        help="instead of the preemption: unplanned failures after step --signal-at, one job each "
                             "(all) or a chosen one: a rank killed, a rank stopped, a loader worker stopped, a node "
                             "lost (rehearsal/faults.py)")
    args = parser.parse_args(argv)
    if args.fault == "none":
        given = list(argv if argv is not None else sys.argv[1:])
        rest = [a for i, a in enumerate(given) if a != "--fault=none" and not (
            a == "--fault" or (i > 0 and given[i - 1] == "--fault"))]
        return preemption(rest)
    try:
        shape = read_script((REPO / args.script).resolve())
        _refuse_bad_input(args, shape)
        parallel = layout(shape, args.overrides)
    except (Refused, BadInput) as e:
        print(f"error: {e}", file=sys.stderr)
        return EXIT_BAD_INPUT
    try:
        result = rehearse_faults(args, shape, parallel)
    except JobFailed as e:
        print(f"rehearsal failed: {e}", file=sys.stderr)
        return 1
    report(result)
    return 0 if all(v is None for v in result["checks"].values()) else 1
