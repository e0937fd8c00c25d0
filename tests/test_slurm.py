"""The real slurm/*.sh scripts on a real local Slurm cluster (slurmctld + 2 slurmd), with CPU overrides."""

import json
import os
import re
import signal
import subprocess
import time
from pathlib import Path

import pytest
from support import REPO, records, tiny_recipe

from convit_scale.rehearsal.cluster import CPU_SBATCH
from convit_scale.rehearsal.faults import children, live_ranks

pytestmark = [pytest.mark.slurm, pytest.mark.slow]

def _env(recipe, out, data, **extra):
    # All "nodes" share this host: rendezvous on loopback (the node names do not resolve here).
    return {"RECIPE": str(recipe), "OUTPUT_DIR": str(out), "DATA_DIR": str(data), "MASTER_ADDR": "127.0.0.1",
            "PYTHON": os.environ.get("PYTHON", str(REPO / ".venv" / "bin" / "python")), **extra}


def _wait(cond, what: str, log, timeout: float):
    t0 = time.time()
    while not cond():
        assert time.time() - t0 < timeout, (f"no {what} after {timeout}s\n"
                                            + (log.read_text()[-3000:] if log.exists() else "no log"))
        time.sleep(0.5)


@pytest.mark.parametrize("env, error", [
    ({"LAUNCHER": "mpirun"},
     "error: LAUNCHER=mpirun is not supported; allowed: srun (one task per GPU) or torchrun (one per node)"),
    ({"MAX_REQUEUES": "-1"}, "error: MAX_REQUEUES=-1 is not allowed; use a whole number >= 0 (default 50)"),
])
def test_launch_refuses_unknown_settings_before_anything_runs(tmp_path, env, error):
    res = subprocess.run(["bash", str(REPO / "slurm" / "launch.sh")], capture_output=True, text=True, cwd=tmp_path,
                         env={"PATH": os.environ["PATH"], "RECIPE": "r.yaml", "OUTPUT_DIR": str(tmp_path / "run"),
                              **env})
    assert res.returncode == 2 and res.stdout == "" and res.stderr == error + "\n", res


@pytest.mark.parametrize("launcher", ["srun", "torchrun"])
def test_preemption_signal_checkpoints_requeues_and_resumes(slurm, fm_tree, tmp_path, launcher):
    """srun: the signal reaches every rank (each is a task). torchrun: it reaches torchrun, one task per
    node, which forwards it to its ranks. The srun job is submitted with a node range (--nodes=1-2) and its second
    node drained after the signal: the requeue comes back on the one node left, and resumes the run on 1 rank."""
    out = tmp_path / "run"
    # 60 steps: the stop comes a few steps after the third (a step is ~0.1 s, the signal's way well under 1 s)
    recipe = tiny_recipe(tmp_path / "r.yaml", "imagefolder", fm_tree, out, schedule={"epochs": 20, "max_steps": 60},
                         checkpoint={"keep_last": 2})
    log = tmp_path / "job.out"
    script = REPO / "slurm" / "convit_b_plus.sh"
    assert "#SBATCH --signal=USR1@" in script.read_text() and "#SBATCH --requeue" in script.read_text()
    elastic = launcher == "srun"
    # --ntasks=2 with one task per node: the first start takes both nodes (of a range, Slurm may give the fewest)
    nodes = ["--nodes=1-2", "--ntasks=2"] if elastic else ["--nodes=2"]
    job = slurm.sbatch(*nodes, *CPU_SBATCH, f"--output={log}", str(script),
                       env=_env(recipe, out, fm_tree, LAUNCHER=launcher), cwd=REPO)
    t0 = time.time()
    while len(records(out)) < 3:  # training is under way
        assert time.time() - t0 < 240, log.read_text()[-3000:] if log.exists() else "no log"
        time.sleep(0.5)
    # Slurm's pre-timeout signal (--signal=USR1@T) reaches every task of the step: send the same now.
    slurm.run("scancel", "--signal=USR1", str(job))
    if elastic:  # as a node that failed its health check: the job keeps it until it ends, its requeue cannot have it
        slurm.run("scontrol", "update", f"NodeName={slurm.nodes[1]}", "State=DRAIN", "Reason=test")
    try:
        t0 = time.time()
        while not records(out, "stopped"):
            assert time.time() - t0 < 120, log.read_text()[-3000:]
            time.sleep(0.5)
        stopped_at = records(out, "stopped")[0]["step"]
        info = slurm.wait_job(job, timeout=600)
    finally:
        if elastic:
            slurm.run("scontrol", "update", f"NodeName={slurm.nodes[1]}", "State=RESUME")
    text = log.read_text()
    assert info["JobState"] == "COMPLETED", text[-4000:]
    assert info.get("Restarts") == "1", info
    assert "requeueing job" in text and "restart 1" in text  # --open-mode=append keeps both runs
    assert f"launcher {launcher}" in text
    if launcher == "torchrun":  # torchrun handled USR1 (by default it would die of it) and waited for its ranks
        assert "death signal, shutting down workers" in text and "closing signal SIGUSR1" in text
    assert f"resumed from {out}/checkpoints/step_{stopped_at:09d} at step {stopped_at}" in text
    assert f"resumed step {stopped_at} from 2 rank(s) on {1 if elastic else 2}" in text
    assert re.findall(r"== nodes (\d+), ", text) == (["2", "1"] if elastic else ["2", "2"])  # both starts
    end = records(out, "end")
    assert len(end) == 1 and end[0]["step"] == 60
    # a planned requeue is no fault: the launcher closed the stopped start, the next start recorded nothing
    assert not (out / "faults.jsonl").exists() and "== fault" not in text, text[-3000:]
    assert [s.get("outcome") for s in _lines(out / "faults_starts.jsonl")] == ["stopped", "exit 0"]
    steps = [r["step"] for r in records(out)]
    assert steps == list(range(1, 61))  # no step lost or repeated across the requeue
    meta = json.loads((out / "checkpoints" / "step_000000060" / "meta.json").read_text())
    assert meta["reason"] == "end"


def test_sigterm_to_a_job_whose_ranks_have_loader_workers_saves_requeues_and_resumes(slurm, fm_tree, tmp_path):
    """Preemption and scancel send SIGTERM to every process of the step, the DataLoader workers included: they
    ignore it, their rank finishes its step and saves, and the job requeues and finishes without losing a step."""
    out = tmp_path / "run"
    recipe = tiny_recipe(tmp_path / "r.yaml", "imagefolder", fm_tree, out, data={"num_workers": 2},
                         schedule={"epochs": 20, "max_steps": 40})
    log = tmp_path / "job.out"
    job = slurm.sbatch("--nodes=1", *CPU_SBATCH, f"--output={log}", str(REPO / "slurm" / "convit_ti.sh"),
                       env=_env(recipe, out, fm_tree), cwd=REPO)
    _wait(lambda: len(records(out)) >= 3, "training steps", log, 240)
    slurm.run("scancel", "--signal=TERM", str(job))
    _wait(lambda: records(out, "stopped"), "stop record", log, 120)
    info = slurm.wait_job(job, timeout=600)
    text = log.read_text()
    assert info["JobState"] == "COMPLETED" and info.get("Restarts") == "1", text[-4000:]
    assert "killed by signal" not in text, text[-4000:]  # no DataLoader worker died of the signal
    assert [r["step"] for r in records(out)] == list(range(1, 41))


def test_stale_marker_does_not_requeue_a_job_that_fails_at_start_up(slurm, fm_tree, tmp_path):
    """A marker left by an earlier stop must not requeue a run whose training never got going (before the
    fix: requeued without end). srun per GPU: each rank gets the job's --cpus-per-task as OpenMP threads."""
    out = tmp_path / "run"
    recipe = tiny_recipe(tmp_path / "r.yaml", "imagefolder", fm_tree, out, schedule={"max_steps": 4})
    out.mkdir()
    (out / "STOPPED_FOR_REQUEUE").write_text("checkpoints/step_000000002")
    log = tmp_path / "job.out"
    job = slurm.sbatch("--nodes=1", "--ntasks-per-node=1", "--gpus-per-node=1", "--cpus-per-task=2", "--time=15",
                       f"--output={log}", str(REPO / "slurm" / "convit_ti.sh"),
                       env=_env(recipe, out, fm_tree, OVERRIDES="checkpoint.resume=/nonexistent"), cwd=REPO)
    info = slurm.wait_job(job, timeout=240)
    text = log.read_text()
    assert info["JobState"] == "FAILED" and info.get("Restarts") == "0", (info, text[-3000:])
    assert "checkpoint.resume: /nonexistent is not a complete checkpoint" in text
    # refused before training (preflight: exit 2) or failing at start-up (exit 1): either way, not requeued
    assert "requeueing" not in text and ("== training exited with status 1" in text
                                         or "== training exited with status 2" in text)
    assert not (out / "STOPPED_FOR_REQUEUE").exists()
    assert "== CPUs per rank 2 (--cpus-per-task=2 per task), OMP_NUM_THREADS=2" in text


def test_requeue_cap_fails_a_job_that_keeps_stopping(slurm, fm_tree, tmp_path):
    """MAX_REQUEUES=1: the first stop requeues, the second fails the job. torchrun per node gets all of the
    node's CPUs (2 tasks x 1 CPU here) and gives each of its ranks its share as OpenMP threads."""
    out = tmp_path / "run"
    recipe = tiny_recipe(tmp_path / "r.yaml", "imagefolder", fm_tree, out, schedule={"epochs": 20, "max_steps": 300})
    log = tmp_path / "job.out"
    job = slurm.sbatch("--nodes=1", "--ntasks-per-node=2", "--gpus-per-node=1", "--cpus-per-task=1", "--time=15",
                       f"--output={log}", str(REPO / "slurm" / "convit_ti.sh"),
                       env=_env(recipe, out, fm_tree, LAUNCHER="torchrun", MAX_REQUEUES="1"), cwd=REPO)
    for run in (1, 2):
        last = max((r["step"] for r in records(out)), default=0)
        _wait(lambda: max((r["step"] for r in records(out)), default=0) > last + 1, f"training in run {run}", log, 240)
        slurm.run("scancel", "--signal=USR1", str(job))
        _wait(lambda: len(records(out, "stopped")) == run, f"stop in run {run}", log, 120)
    info = slurm.wait_job(job, timeout=120)
    text = log.read_text()
    assert info["JobState"] == "FAILED" and info.get("Restarts") == "1", (info, text[-3000:])
    assert text.count("== stopped before the time limit with a checkpoint; requeueing job") == 1
    assert (f"error: job {job} stopped with a checkpoint but was already requeued 1 times (MAX_REQUEUES=1); "
            f"not requeueing: resubmit to resume from {out}/checkpoints") in text
    assert "== CPUs per rank 2 (node CPUs 2 / 1 rank(s) per node), OMP_NUM_THREADS=2" in text
    assert "== node 0: torchrun has 2 CPUs, ranks get OMP_NUM_THREADS=2" in text  # what the step really got
    assert "Setting OMP_NUM_THREADS environment variable" not in text  # torchrun's default of 1 thread


FAST_FAULTS = {"hang_timeout_s": 6, "heartbeat_s": 1, "collective_timeout_s": 30, "startup_timeout_s": 180,
               "long_phase_timeout_s": 30}
"""Short watchdog timeouts for the fault tests (a 2-core machine: start-up and saves still get room)."""
SLOW_STEPS = {"CONVIT_SCALE_STEP_DELAY_S": "0.2"}
"""The tiny recipe's steps take ~30 ms: a fault sent from outside, by a test that sees the run through files written
every second, needs steps it can land between."""


def _lines(path):
    return [json.loads(line) for line in path.read_text().splitlines()] if path.is_file() else []


def _training_past_a_new_checkpoint(out, world=2):
    """This start saved a checkpoint newer than the one it started from, and every rank is training."""
    starts = _lines(out / "faults_starts.jsonl")
    ckpts = [int(p.name[5:]) for p in (out / "checkpoints").glob("step_*[0-9]") if (p / "meta.json").is_file()]
    beats = live_ranks(out, FAST_FAULTS["heartbeat_s"])
    return bool(starts and ckpts and max(ckpts) > starts[-1]["checkpoint_step"] and len(beats) == world
                and all(b["started"] for b in beats.values()))


def _rank_0_mid_epoch(out, steps_per_epoch=31):
    """Past a new checkpoint, and rank 0 well inside an epoch (1,000 images in batches of 32), so its loader worker
    exists and will be asked for batches: one stopped as the epoch ends is only left behind (the DataLoader's
    shutdown gives up on it after 5 s), and between epochs there is none to stop. The heartbeat's step is up to a
    beat (1 s, STEP_DELAY: 5 steps) old."""
    if not _training_past_a_new_checkpoint(out):
        return False
    rank0 = live_ranks(out, FAST_FAULTS["heartbeat_s"]).get(0)
    return bool(rank0 and 2 <= rank0["step"] % steps_per_epoch <= steps_per_epoch - 14 and children(rank0["pid"]))


def test_a_crash_a_hang_and_a_stopped_loader_worker_recover_in_the_allocation_and_a_repeat_ends_it(slurm, fm_tree,
                                                                                                  tmp_path):
    """One 2-node job (srun, one rank per node, a loader worker each) suffers, one after the other: rank 1 killed
    (SIGKILL), rank 1 stopped (SIGSTOP: rank 0's watchdog ends it), rank 0's loader worker stopped (rank 0's
    watchdog ends it in its data phase), each after a checkpoint newer than the last start; every one is named in
    the log and faults.jsonl and the job comes back in a new srun step by itself. Then rank 1 dies at step 40 at
    every start (CONVIT_SCALE_KILL_AT_STEP): restarted once, then the job ends with the diagnosis, not a loop."""
    out = tmp_path / "run"
    recipe = tiny_recipe(tmp_path / "r.yaml", "imagefolder", fm_tree, out, data={"num_workers": 1, "val_path": ""},
                         schedule={"epochs": 20, "max_steps": 80}, checkpoint={"every_steps": 3, "keep_last": 2},
                         fault=FAST_FAULTS)
    log = tmp_path / "job.out"
    job = slurm.sbatch("--nodes=2", *CPU_SBATCH, f"--output={log}", str(REPO / "slurm" / "convit_ti.sh"),
                       env=_env(recipe, out, fm_tree, CONVIT_SCALE_KILL_AT_STEP="40:1", **SLOW_STEPS), cwd=REPO)
    faults = out / "faults.jsonl"
    injected = []
    for what in ("kill rank 1", "stop rank 1", "stop rank 0's worker"):
        ready = _training_past_a_new_checkpoint if what != "stop rank 0's worker" else _rank_0_mid_epoch
        _wait(lambda: ready(out), f"training before '{what}'", log, 300)
        beats = live_ranks(out, FAST_FAULTS["heartbeat_s"])  # the pids of this start's ranks, alive a second ago
        if what == "kill rank 1":
            os.kill(beats[1]["pid"], signal.SIGKILL)
        elif what == "stop rank 1":
            os.kill(beats[1]["pid"], signal.SIGSTOP)
        else:
            for pid in children(beats[0]["pid"]):
                os.kill(pid, signal.SIGSTOP)
        injected.append(time.time())
        n = len(injected)
        _wait(lambda: len(_lines(faults)) >= n, f"the record of '{what}'", log, 120)
    info = slurm.wait_job(job, timeout=600)
    text = log.read_text()
    recs = _lines(faults)
    assert info["JobState"] == "FAILED" and info.get("Restarts") == "0", (info, text[-4000:])
    kinds = [(r["kind"], r["rank"], r["node"], r["action"]) for r in recs]
    assert kinds == [("crash", 1, "n2", "restart"), ("hang", 1, "n2", "restart"), ("hang", 0, "n1", "restart"),
                     ("crash", 1, "n2", "restart"), ("crash", 1, "n2", "stop")], (kinds, text[-4000:])
    assert recs[0]["signal"] == 9 and recs[3]["step"] == recs[4]["step"] == 39  # killed as step 40 began
    # the stop lands wherever rank 1 is: in a step, its log step, or a checkpoint save (one every 3 steps)
    assert recs[1]["phase"] in ("data", "forward/backward", "reduction", "log step", "checkpoint save")
    assert recs[1]["waiting"] == [0]
    assert recs[2]["phase"] == "data" and recs[2]["stopped_workers"] and recs[2]["waiting"] == [1]
    for r, t in zip(recs[1:3], injected[1:3]):  # a hang: the stacks within the timeout of the phase rank 0 waited
        # in (6 s in a step; 30 s in a checkpoint, where rank 0 waits when rank 1 stopped in or just before one)
        assert r["limit_s"] in (FAST_FAULTS["hang_timeout_s"], FAST_FAULTS["long_phase_timeout_s"]), r
        assert r["time"] - t < r["limit_s"] + 10 and Path(r["stacks"]).is_file(), r
    assert all(r["back_s"] > 0 and r["steps_redone"] >= 0 and r["first_new_step"] == r["resumed_from"] + 1
               for r in recs[:3]), recs  # the 4th start never made a step: its record stays open
    assert "== fault: crash (signal 9) of rank 1 on n2 in " in text
    assert "== fault: hang of rank 1 on n2 in " in text and "ranks 0 were waiting for it" in text
    assert "fault: hang of rank 0 on n1 in step" in text and "(data)" in text and "stopped loader worker" in text
    assert "Current thread" in text or "Thread 0x" in text  # the stacks are in the job log
    assert text.count("in this allocation: a new srun step from the newest checkpoint") == 4
    assert ("error: fault: crash (signal 9) of rank 1 on n2 in data (epoch start) after step 39" in text
            and "(the same failure at the same step as the last start); no checkpoint newer than at this start" in text)
    assert "recovered from the hang of rank 1 on n2" in text
    steps = [r["step"] for r in records(out)]
    assert steps == list(range(1, 40)), steps  # every step logged once, up to the one that always fails


def test_a_lost_node_requeues_the_job_onto_the_nodes_left(slurm, fm_tree, tmp_path):
    """A node range job (--nodes=1-2) loses a node: its rank killed and the node drained, as after a failed health
    check. The allocation is not whole: the job requeues itself and continues on the node left, on 1 rank."""
    out = tmp_path / "run"
    recipe = tiny_recipe(tmp_path / "r.yaml", "imagefolder", fm_tree, out, data={"val_path": ""},
                         schedule={"epochs": 20, "max_steps": 16}, checkpoint={"every_steps": 3, "keep_last": 2},
                         fault=FAST_FAULTS)
    log = tmp_path / "job.out"
    job = slurm.sbatch("--nodes=1-2", "--ntasks=2", *CPU_SBATCH, f"--output={log}",
                       str(REPO / "slurm" / "convit_b_plus.sh"), env=_env(recipe, out, fm_tree, **SLOW_STEPS),
                       cwd=REPO)
    _wait(lambda: _training_past_a_new_checkpoint(out), "training past a checkpoint", log, 300)
    lost = next(b for b in live_ranks(out, FAST_FAULTS["heartbeat_s"]).values() if b["node"] == slurm.nodes[1])
    slurm.run("scontrol", "update", f"NodeName={slurm.nodes[1]}", "State=DRAIN", "Reason=test")
    try:
        os.kill(lost["pid"], signal.SIGKILL)
        info = slurm.wait_job(job, timeout=600)
    finally:
        slurm.run("scontrol", "update", f"NodeName={slurm.nodes[1]}", "State=RESUME")
    text = log.read_text()
    assert info["JobState"] == "COMPLETED" and info.get("Restarts") == "1", (info, text[-4000:])
    (rec,) = _lines(out / "faults.jsonl")
    assert (rec["kind"], rec["rank"], rec["node"], rec["action"]) == ("node_lost", lost["rank"], "n2", "requeue")
    assert f"fault: node lost of rank {lost['rank']} on n2" in text and "node(s) n2 is out of the allocation" in text
    assert "the next start needs a new allocation; requeueing job" in text
    assert f"resumed step {rec['checkpoint_step']} from 2 rank(s) on 1" in text
    assert rec["back_s"] > 0 and rec["first_new_step"] == rec["checkpoint_step"] + 1
    assert [r["step"] for r in records(out)] == list(range(1, 17))
