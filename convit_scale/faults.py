"""Unplanned failures of a run, as its launcher sees them: what failed (a crash with its signal or exit status, an
OOM, a hang, a lost node), where (rank, node, step, phase), how long it took to notice, and what to do about it.

``slurm/launch.sh`` calls ``python -m convit_scale.faults`` around each training step of the job (imports no torch):

- ``start``: before each srun step: the newest checkpoint now (the progress rule below compares with it), and a
  record for a start that ended without the launcher saying how (Slurm requeued the job after a node failure);
- ``close``: after a step that ended as planned (finished, refused, stopped for its requeue): how it ended, so that
  the next start does not take it for a start that ended unseen;
- ``end``: after it: one line in the job log and one record in ``run_dir/faults.jsonl`` per fault, from the ranks'
  heartbeats and hang reports (train/watchdog.py) and srun's or torchrun's account of the first task that failed;
  then the action it prints for the launcher: ``restart`` (a new srun step inside the allocation, which is still
  whole), ``requeue`` (a node of the allocation is down or drained: onto the nodes Slurm still has; or the time
  limit is nearer than its stop signal's lead), or ``stop``.

A restart happens only when the run made progress since the last start: a checkpoint newer than the newest one at
that start. The same failure at the same step twice therefore ends the job after one retry, with a one-line
diagnosis, instead of a loop. The resumed run's rank 0 completes the record at its first new step (``recovered``:
the time back to it and the steps redone).
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import time
from pathlib import Path

from .files import write_atomic
from .runfolder import (
    EXIT_BAD_INPUT,
    EXIT_STORAGE,
    FAULTS,
    HANGS,
    HEARTBEAT,
    METRICS,
    STARTS,
    checkpoint_step,
    checkpoints,
    complete_checkpoints,
)

DATA, COMPUTE, REDUCE, LOG = "data", "forward/backward", "reduction", "log step"
STEP_PHASES = (DATA, COMPUTE, REDUCE)
"""The phases inside a step, in order (train/watchdog.py marks them; a heartbeat's step is the one finished before
them); the others come after a step (the log step, checkpoints, evaluation) and carry that step."""


def progress_key(step: int, phase: str) -> tuple[int, int]:
    """How far a rank got, comparable across ranks: (the step it is in or just finished, the phase's place)."""
    if phase in STEP_PHASES:
        return step + 1, STEP_PHASES.index(phase)
    return step, len(STEP_PHASES)
SIGNALS = {"Killed": 9, "Terminated": 15, "Segmentation fault": 11, "Aborted": 6, "Bus error": 7}
KINDS = ("crash", "oom", "hang", "node_lost", "storage", "refused")
"""The faults the launcher records (``faults.jsonl`` also holds the ranks' records of damaged checkpoints)."""
UNHEALTHY = ("DOWN", "DRAIN", "FAIL", "NOT_RESPONDING", "POWER")
"""Slurm node states (any part of the state) that take a node out of the allocation's next step."""


def where(step: int, phase: str) -> str:
    """Where a rank was, from its heartbeat (``step``: steps it had finished)."""
    return f"step {step + 1} ({phase})" if phase in STEP_PHASES else f"{phase} after step {step}"


def _lines(path: Path) -> list[dict]:
    if not path.is_file():
        return []
    out = []
    for line in path.read_text().splitlines():
        try:
            out.append(json.loads(line))
        except ValueError:
            continue  # a line being written when the job died
    return out


def _append(path: Path, rec: dict) -> None:
    with open(path, "a") as f:
        f.write(json.dumps(rec) + "\n")


def newest_checkpoint_step(out: Path) -> int:
    """The step of the run's newest complete checkpoint (one with meta.json), -1 for none."""
    found = complete_checkpoints(checkpoints(out))
    return checkpoint_step(found[-1]) if found else -1


def _json_files(folder: Path, since: float) -> list[dict]:
    found = []
    for f in sorted(folder.glob("rank_*.json")):
        try:
            rec = json.loads(f.read_text())
        except (OSError, ValueError):
            continue
        if f.stat().st_mtime >= since - 1:
            found.append(rec)
    return found


def last_logged_step(out: Path) -> int | None:
    """The newest step in the run's metrics.jsonl (its last 64 KiB): what rank 0 logged last."""
    path = out / METRICS
    if not path.is_file():
        return None
    with open(path, "rb") as f:
        f.seek(max(0, path.stat().st_size - 65536))
        tail = f.read().decode(errors="replace").splitlines()
    for line in reversed(tail):
        try:
            rec = json.loads(line)
        except ValueError:
            continue
        if rec.get("kind") == "train":
            return rec["step"]
    return None


def first_failed_task(log: str) -> dict | None:
    """The first task that failed, as srun (``srun: error: n2: task 1: Killed``) or torchrun (its "Root Cause
    (first observed failure)") reports it: rank, node, and the signal or exit status."""
    m = re.search(r"srun: error: (\S+): tasks? (\d+)[\d,\-]*: (.+)", log)
    if m:
        node, rank, what = m.group(1), int(m.group(2)), m.group(3).strip()
        code = re.match(r"Exited with exit code (\d+)", what)
        return {"rank": rank, "node": node, "signal": SIGNALS.get(what), "exit_status": int(code.group(1))
                if code else None, "how": what}
    m = re.search(r"Root Cause \(first observed failure\):.*?host\s*:\s*(\S+).*?rank\s*:\s*(\d+).*?exitcode\s*:\s*"
                  r"(-?\d+)", log, re.S)
    if m:
        code = int(m.group(3))
        return {"rank": int(m.group(2)), "node": m.group(1), "signal": -code if code < 0 else None,
                "exit_status": code if code >= 0 else None, "how": f"exitcode {code}"}
    return None


SQUEUE_TIMEOUT_S = 30
"""How long the launcher waits for ``squeue``'s or ``scontrol``'s answer (a slurmctld that does not answer must not
hold the job)."""


def node_states(nodes: list[str]) -> dict[str, str]:
    """Slurm's state of each node (``scontrol show node``); empty where scontrol cannot answer."""
    if not nodes:
        return {}
    try:
        res = subprocess.run(["scontrol", "show", "node", "-o", ",".join(nodes)], capture_output=True, text=True,
                             timeout=SQUEUE_TIMEOUT_S)
    except (OSError, subprocess.TimeoutExpired):
        return {}
    found = {}
    for line in res.stdout.splitlines():
        fields = dict(kv.split("=", 1) for kv in line.split() if "=" in kv)
        if "NodeName" in fields:
            found[fields["NodeName"]] = fields.get("State", "")
    return found


SIGNAL_LEAD_S = 300
"""The slurm/ scripts' ``--signal=USR1@300``: Slurm's one pre-timeout signal comes this long before the time limit."""
RESTART_MIN_TIME_LEFT_S = SIGNAL_LEAD_S + 60 + 120
"""A restart inside the allocation needs this long before the time limit: the signal's lead, the up to 60 s earlier
that Slurm may send it (sbatch's ``--signal``), and a start to its first step (imports, rendezvous, the checkpoint's
load). With less, a new step would not see the signal: it would train unsaved until the limit killed it."""


def job_time_left(job: str) -> float | None:
    """Seconds before the job's time limit (``squeue -o %L``); None without a job, a limit or an answer (no
    ``squeue`` on the node, or none within ``SQUEUE_TIMEOUT_S``): the decision then goes by the fault alone."""
    if not job:
        return None
    try:
        res = subprocess.run(["squeue", "-h", "-j", job, "-o", "%L"], capture_output=True, text=True,
                             timeout=SQUEUE_TIMEOUT_S)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return parse_time_left(res.stdout.strip()) if res.returncode == 0 else None


def parse_time_left(text: str) -> float | None:
    """Slurm's ``[days-]hours:minutes:seconds``, ``minutes:seconds`` or ``seconds`` in seconds; 0 for INVALID (what
    squeue prints past the limit, in the cluster's OverTimeLimit); None for anything else (UNLIMITED, NOT_SET,
    nothing)."""
    if text == "INVALID":
        return 0.0
    days, _, clock = text.rpartition("-") if "-" in text else ("0", "", text)
    parts = clock.split(":")
    if not text or not days.isdigit() or len(parts) > 3 or not all(p.isdigit() for p in parts):
        return None
    seconds = 0
    for p in parts:
        seconds = 60 * seconds + int(p)
    return float(int(days) * 86400 + seconds)


def classify(rc: int, beats: list[dict], hangs: list[dict], task: dict | None, log: str,
             lost: list[str]) -> dict:
    """The fault of an ended step: kind, rank, node, where, and the ranks that were only waiting."""
    by_rank = {b["rank"]: b for b in beats}
    failed = [b for b in beats if str(b.get("state", "")).startswith("failed")]
    on_lost = [b for b in beats if b.get("node") in lost]
    if lost:  # first: the lost node's ranks also stop their heartbeats, which the watchdogs report as a hang
        b = min(on_lost, key=lambda b: b["alive"]) if on_lost else {}
        return {"kind": "node_lost", "rank": b.get("rank"), "node": b.get("node", lost[0]), "step": b.get("step"),
                "phase": b.get("phase"), "ranks": sorted(x["rank"] for x in on_lost), "exit_status": rc}
    first = min(hangs, key=lambda h: h["time"]) if hangs else {}
    culprit = (first.get("culprits") or [{}])[0]
    # A rank that died by a signal before anyone else failed went silent too, and a watchdog may have reported the
    # silence before the launcher ended the step: the launcher's first failure decides that it was a crash.
    died_first = bool(task and task.get("signal") and task.get("rank") == culprit.get("rank"))
    if hangs and not died_first:
        beat = by_rank.get(culprit.get("rank"), {})
        children = [c for h in hangs for c in h.get("children", [])]
        stopped = [c for c in children if c.get("state") in ("T", "t", "D")]
        locked = [c for c in children if c.get("state") == "S" and "futex" in str(c.get("wchan", ""))]
        return {"kind": "hang", "rank": culprit.get("rank"), "node": culprit.get("node"),
                "step": beat.get("step", first["step"]), "phase": beat.get("phase", first["phase"]),
                "detect_s": round(first["time"] - beat.get("since", first["since"]), 1),  # its last progress
                "limit_s": first.get("limit_s"),  # the timeout of the phase the detecting rank waited in
                "waiting": [w["rank"] for w in first.get("waiting", [])], "summary": first.get("summary"),
                "stopped_workers": stopped, "locked_workers": locked, "stacks": first.get("stacks"),
                "exit_status": rc}
    storage = storage_fault(rc, beats, task, log)
    if storage is not None:
        return storage
    refused = refused_fault(rc, beats, task)
    if refused is not None:
        return refused
    oom = [b for b in failed if re.search(r"OutOfMemoryError|MemoryError", b["state"])]
    if oom or re.search(r"oom[_-]kill|Out Of Memory", log):
        b = oom[0] if oom else by_rank.get((task or {}).get("rank"), {})
        return {"kind": "oom", "rank": b.get("rank"), "node": b.get("node", (task or {}).get("node")),
                "step": b.get("step"), "phase": b.get("phase"), "exit_status": rc, "how": b.get("state")}
    b = by_rank.get(task["rank"], {}) if task else (failed[0] if failed else {})
    task = task or {}
    return {"kind": "crash", "rank": task.get("rank", b.get("rank")), "node": task.get("node", b.get("node")),
            "step": b.get("step"), "phase": b.get("phase"), "signal": task.get("signal"),
            "exit_status": task.get("exit_status", rc),
            "how": task.get("how") or (b.get("state") if str(b.get("state", "")).startswith("failed") else None)}


def storage_fault(rc: int, beats: list[dict], task: dict | None, log: str) -> dict | None:
    """A save the file system refused or that would not fit (a rank's ``EXIT_STORAGE``, its heartbeat's last state
    a StorageError, or its ``error:`` line): the fault, with that line."""
    failed = [b for b in beats if str(b.get("state", "")).startswith("failed: StorageError")]
    line = re.search(r"^error: (checkpoint at step .*)$", log, re.M)
    if not (failed or rc == EXIT_STORAGE or (task or {}).get("exit_status") == EXIT_STORAGE):
        return None
    b = failed[0] if failed else {}
    how = line.group(1) if line else (b.get("state", "")[len("failed: StorageError: "):] or None)
    return {"kind": "storage", "rank": b.get("rank", (task or {}).get("rank")), "node": b.get("node"),
            "step": b.get("step"), "phase": b.get("phase"), "exit_status": rc, "how": how}


def refused_fault(rc: int, beats: list[dict], task: dict | None) -> dict | None:
    """A rank that refused the run's data or settings during training (a ``DataError``: too many unreadable samples,
    a decoder that refuses whole batches; it exits with ``EXIT_BAD_INPUT``), seen by the launcher as the first
    task's exit status or the rank's last heartbeat: the launcher ends the other ranks, so the step's own status is
    a signal's (srun) or 1 (torchrun)."""
    failed = [b for b in beats if re.match(r"failed: (DataError|ConfigError): ", str(b.get("state", "")))]
    if not (failed or (task or {}).get("exit_status") == EXIT_BAD_INPUT):
        return None
    b = failed[0] if failed else {}
    return {"kind": "refused", "rank": b.get("rank", (task or {}).get("rank")), "node": b.get("node"),
            "step": b.get("step"), "phase": b.get("phase"), "exit_status": rc,
            "how": b.get("state", "")[len("failed: "):] or None}


def describe(rec: dict) -> str:
    """The job log's one line for a fault."""
    kind = {"crash": "crash", "oom": "out of memory", "hang": "hang", "node_lost": "node lost",
            "storage": "storage failure", "refused": "input refused"}[rec["kind"]]
    if rec["kind"] == "crash":
        kind += f" (signal {rec['signal']})" if rec.get("signal") else f" (exit status {rec.get('exit_status')})"
    at = where(rec["step"], rec["phase"]) if rec.get("step") is not None and rec.get("phase") else "an unknown step"
    text = f"fault: {kind} of rank {rec.get('rank')} on {rec.get('node')} in {at}"
    if rec.get("detect_s") is not None:
        text += f", detected after {rec['detect_s']:g} s"
    if rec.get("waiting"):
        text += f"; ranks {', '.join(map(str, rec['waiting']))} were waiting for it"
    if rec.get("stopped_workers"):
        text += "; stopped loader worker(s) " + ", ".join(str(c["pid"]) for c in rec["stopped_workers"])
    if rec.get("locked_workers"):  # forked from a process whose other threads held locks: one may never be released
        text += "; loader worker(s) waiting on a lock (futex) " + ", ".join(
            str(c["pid"]) for c in rec["locked_workers"])
    if rec.get("how") and rec["kind"] != "hang":
        text += f" [{rec['how']}]"
    return text


def _rewrite(path: Path, recs: list[dict]) -> None:
    write_atomic(path, "".join(json.dumps(r) + "\n" for r in recs))


def _close_start(out: Path, outcome: str) -> dict | None:
    """Mark the newest start with how it ended; returns it (None if no start was recorded)."""
    starts = _lines(out / STARTS)
    if not starts:
        return None
    starts[-1]["outcome"] = outcome
    _rewrite(out / STARTS, starts)
    return starts[-1]


def start(out: Path, job: str, restart: int, nodes: list[str]) -> dict:
    """Before a start: a record for the previous start if it ended unseen (Slurm requeued the job after a node
    failure, or killed it), then this start's (the newest checkpoint now, which the progress rule compares with)."""
    out.mkdir(parents=True, exist_ok=True)
    starts = _lines(out / STARTS)
    if starts and "outcome" not in starts[-1]:
        beats = _json_files(out / HEARTBEAT, starts[-1]["time"])
        last = min(beats, key=lambda b: b["alive"]) if beats else {}
        rec = {"kind": "node_lost", "rank": last.get("rank"), "node": last.get("node"), "step": last.get("step"),
               "phase": last.get("phase"), "how": "the job was ended without its launcher (Slurm requeued it after "
               "a node failure, or it was killed)", "time": time.time(), "job": starts[-1]["job"],
               "restart": starts[-1]["restart"], "checkpoint_step": newest_checkpoint_step(out),
               "action": "requeued by Slurm"}
        _append(out / FAULTS, rec)
        _close_start(out, "lost")
        print(f"== {describe(rec)}; requeued by Slurm", file=sys.stderr, flush=True)
    attempt = sum(1 for s in starts if s.get("job") == job and s.get("restart") == restart)
    rec = {"time": time.time(), "job": job, "restart": restart, "attempt": attempt,
           "checkpoint_step": newest_checkpoint_step(out), "nodes": nodes}
    _append(out / STARTS, rec)
    for f in (out / HEARTBEAT).glob("rank_*.json"):
        f.unlink(missing_ok=True)
    return rec


def archive(out: Path, rec: dict, start_no: int) -> None:
    """Move the start's hang reports and stacks into hangs/start_<n>/ (a later start's diagnosis must not read
    them; the operator still can)."""
    folder = out / HANGS / f"start_{start_no}"
    for f in (out / HANGS).glob("rank_*"):
        folder.mkdir(parents=True, exist_ok=True)
        f.replace(folder / f.name)
    if rec.get("stacks"):
        rec["stacks"] = str(folder / Path(rec["stacks"]).name)


def decide(rec: dict, begun: dict, lost: list[str], restarts: int, max_restarts: int,
           previous: list[dict] | None = None, time_left: float | None = None) -> tuple[str, str]:
    """(action, why): restart inside the allocation, requeue onto the nodes left, or stop. A storage failure is
    restarted into at most once per job (``previous``: the job's earlier fault records). With less than
    ``RESTART_MIN_TIME_LEFT_S`` before the time limit (``time_left``), a restart is a requeue: Slurm's pre-timeout
    signal is sent, or will be before the new step trains, which would then train until the limit killed it,
    unsaved; and a job ended by its limit is not requeued."""
    now = rec["checkpoint_step"]
    if rec["kind"] == "refused":
        return "stop", ("the run refused its data or settings (the rank's error above): a restart would refuse them "
                        "again; fix them, then resubmit to resume")
    if rec["kind"] == "storage" and any(f.get("kind") == "storage" for f in previous or []):
        return "stop", ("the same storage failure as an earlier start of this job: not restarting into it again "
                        "(free space, raise the quota or fix the folder's permissions, then resubmit to resume)")
    if now <= begun["checkpoint_step"]:
        at = f"step {begun['checkpoint_step']}" if begun["checkpoint_step"] >= 0 else "no checkpoint"
        return "stop", (f"no checkpoint newer than at this start ({at}): a restart would repeat the same steps and "
                        f"likely the same failure; not restarting (fix the cause, then resubmit to resume)")
    if restarts >= max_restarts:
        return "stop", f"already restarted {restarts} times in this allocation (MAX_RESTARTS={max_restarts})"
    if lost:
        return "requeue", f"node(s) {', '.join(lost)} {'is' if len(lost) == 1 else 'are'} out of the allocation"
    if time_left is not None and time_left < RESTART_MIN_TIME_LEFT_S:
        return "requeue", (f"{time_left:.0f} s left before the time limit: too little for a new step to start and "
                           f"still see its {SIGNAL_LEAD_S} s stop signal; resuming from checkpoint step {now} in a "
                           f"new allocation")
    return "restart", f"resuming from checkpoint step {now} in the same allocation"


def end(out: Path, rc: int, log: str, nodes: list[str], max_restarts: int) -> str:
    """After a failed step: the fault's record and log line; returns the action (``decide``)."""
    starts = _lines(out / STARTS)
    begun = starts[-1] if starts else {"time": 0.0, "checkpoint_step": -1, "job": "", "restart": 0, "attempt": 0}
    states = node_states(nodes)
    lost = [n for n, s in states.items() if any(u in s for u in UNHEALTHY)]
    beats = _json_files(out / HEARTBEAT, begun["time"])
    hangs = _json_files(out / HANGS, begun["time"])
    rec = classify(rc, beats, hangs, first_failed_task(log), log, lost)
    now = time.time()
    culprit = next((b for b in beats if b["rank"] == rec.get("rank")), None)
    if rec.get("detect_s") is None and culprit is not None:  # at most this long: its last heartbeat to the step's end
        rec["detect_s"] = round(now - culprit["alive"], 1)
    last = max([b["step"] for b in beats] + [s for s in [last_logged_step(out)] if s is not None], default=None)
    if rec["kind"] != "hang" and last is not None:  # a heartbeat may be a period behind: the newest step finished
        rec["step"] = max(rec.get("step") or 0, last)
    archive(out, rec, len(starts))
    rec.update(time=now, last_step=last, job=begun["job"],
               restart=begun["restart"], attempt=begun["attempt"],
               checkpoint_step=newest_checkpoint_step(out), checkpoint_step_at_start=begun["checkpoint_step"])
    restarts = sum(1 for s in starts if s.get("job") == begun["job"] and s.get("restart") == begun["restart"]) - 1
    previous = [f for f in _lines(out / FAULTS) if f.get("job") == begun["job"] and f.get("kind") in KINDS]
    action, why = decide(rec, begun, lost, restarts, max_restarts, previous, job_time_left(begun["job"]))
    rec.update(action=action, reason=why)
    _append(out / FAULTS, rec)
    _close_start(out, f"fault: {rec['kind']}")
    same = previous and (previous[-1].get("kind"), previous[-1].get("step")) == (rec["kind"], rec["step"])
    line = describe(rec)
    if action == "stop":
        print(f"error: {line}{' (the same failure at the same step as the last start)' if same else ''}; {why}",
              file=sys.stderr, flush=True)
    else:
        print(f"== {line}; {why}", file=sys.stderr, flush=True)
    return action


def recovered(out: Path, resumed_from: int, step: int) -> dict | None:
    """At the first new step after a restart (rank 0): the newest fault record completed with the time back to it
    and the steps redone; None when the newest fault is already complete (or there is none)."""
    path = out / FAULTS
    recs = _lines(path)
    ours = [r for r in recs if r.get("kind") in KINDS]  # not the ranks' own records (a damaged checkpoint set aside)
    if not ours or "back_s" in ours[-1] or ours[-1].get("action") == "stop":
        return None
    rec = ours[-1]
    done = rec.get("last_step", rec.get("step"))
    rec.update(back_s=round(time.time() - rec["time"], 1), first_new_step=step, resumed_from=resumed_from,
               steps_redone=None if done is None else max(0, done - resumed_from))
    _rewrite(path, recs)
    return rec


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m convit_scale.faults", description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    s = sub.add_parser("start", help="before a training step of the job")
    e = sub.add_parser("end", help="after a failed training step of the job: prints restart, requeue or stop")
    c = sub.add_parser("close", help="after a training step of the job that ended as planned")
    for q in (s, e, c):
        q.add_argument("--out", required=True, type=Path, help="the run folder")
    for q in (s, e):
        q.add_argument("--nodes", default="", help="the allocation's nodes, comma separated")
    c.add_argument("--outcome", required=True, help="how the step ended, e.g. 'stopped' or 'exit 0'")
    s.add_argument("--job", default="")
    s.add_argument("--restart", type=int, default=0, help="SLURM_RESTART_COUNT")
    e.add_argument("--rc", type=int, required=True, help="the step's exit status")
    e.add_argument("--log", type=Path, default=None, help="srun's or torchrun's messages of the step")
    e.add_argument("--max-restarts", type=int, default=20)
    return p


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    nodes = [n for n in getattr(args, "nodes", "").split(",") if n]
    if args.cmd == "start":
        start(args.out, args.job, args.restart, nodes)
        return 0
    if args.cmd == "close":
        _close_start(args.out, args.outcome)
        return 0
    log = args.log.read_text(errors="replace") if args.log is not None and args.log.is_file() else ""
    print(end(args.out, args.rc, log, nodes, args.max_restarts))
    return 0


if __name__ == "__main__":
    sys.exit(main())
