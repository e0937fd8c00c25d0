"""The real slurm/*.sh scripts on a real local Slurm cluster (slurmctld + 2 slurmd), with CPU overrides."""

import json
import os
import re
import subprocess
import time

import pytest
from support import REPO, records, tiny_recipe

from convit_scale.rehearsal.cluster import CPU_SBATCH

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


def test_two_node_fsdp2_job_trains_and_evaluates(slurm, fm_wds, tmp_path):
    out = tmp_path / "run"
    recipe = tiny_recipe(tmp_path / "r.yaml", "wds", fm_wds, out, schedule={"max_steps": 4})
    log = tmp_path / "job.out"
    job = slurm.sbatch("--nodes=2", *CPU_SBATCH, f"--output={log}", str(REPO / "slurm" / "convit_tiny.sh"),
                       env=_env(recipe, out, fm_wds, LAUNCHER="torchrun"), cwd=REPO)
    info = slurm.wait_job(job, timeout=300)
    text = log.read_text()
    assert info["JobState"] == "COMPLETED", text[-3000:]
    assert "nodes 2" in text and "launcher torchrun" in text
    assert ("2 rank(s) on cpu (gloo, launched by torchrun)" in text
            and "global batch 32 = micro 16 x accumulation 1 x world 2" in text)
    assert "model:" in text  # the resolved recipe is printed at the top of the log
    assert len(records(out)) == 4
    ev = records(out, "eval")
    assert ev and ev[-1]["samples"] == 200  # the whole val split, counted once


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
    script = REPO / "slurm" / "convit_base_plus.sh"
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
    job = slurm.sbatch("--nodes=1", *CPU_SBATCH, f"--output={log}", str(REPO / "slurm" / "convit_tiny.sh"),
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
                       f"--output={log}", str(REPO / "slurm" / "convit_tiny.sh"),
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
                       f"--output={log}", str(REPO / "slurm" / "convit_tiny.sh"),
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
