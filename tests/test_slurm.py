"""The real slurm/*.sh scripts on a real local Slurm cluster (slurmctld + 2 slurmd), with CPU overrides."""

import json
import os
import time

import pytest

from conftest import REPO, records, tiny_recipe
from slurm_cluster import LocalSlurm, missing_requirements

pytestmark = [pytest.mark.slurm, pytest.mark.slow]

# CPU stand-ins for the scripts' GPU settings: 1 task and 1 (count-only) GPU per node, 1 CPU.
CPU_SBATCH = ["--ntasks-per-node=1", "--gpus-per-node=1", "--cpus-per-task=1", "--time=15"]


@pytest.fixture(scope="module")
def slurm(tmp_path_factory):
    why = missing_requirements()
    if why:
        pytest.fail(f"cannot start the local Slurm cluster: {why}")
    cluster = LocalSlurm(tmp_path_factory.mktemp("slurm")).start()
    yield cluster
    cluster.stop()


def _env(recipe, out, data, **extra):
    # All "nodes" share this host: rendezvous on loopback (the node names do not resolve here).
    return {"RECIPE": str(recipe), "OUTPUT_DIR": str(out), "DATA_DIR": str(data), "MASTER_ADDR": "127.0.0.1",
            "PYTHON": os.environ.get("PYTHON", str(REPO / ".venv" / "bin" / "python")), **extra}


def test_two_node_fsdp2_job_trains_and_evaluates(slurm, fm_wds, tmp_path):
    out = tmp_path / "run"
    recipe = tiny_recipe(tmp_path / "r.yaml", "wds", fm_wds, out, schedule={"max_steps": 4})
    log = tmp_path / "job.out"
    job = slurm.sbatch("--nodes=2", *CPU_SBATCH, f"--output={log}", str(REPO / "slurm" / "convit_ti.sh"),
                       env=_env(recipe, out, fm_wds, LAUNCHER="torchrun"), cwd=REPO)
    info = slurm.wait_job(job, timeout=300)
    text = log.read_text()
    assert info["JobState"] == "COMPLETED", text[-3000:]
    assert "nodes 2" in text and "launcher torchrun" in text
    assert "2 rank(s) on cpu (gloo, launched by torchrun)" in text and "global batch 32 = micro 16 x accumulation 1 x world 2" in text
    assert "model:" in text  # the resolved recipe is printed at the top of the log
    assert len(records(out)) == 4
    ev = records(out, "eval")
    assert ev and ev[-1]["samples"] == 200  # the whole val split, counted once


@pytest.mark.parametrize("launcher", ["srun", "torchrun"])
def test_preemption_signal_checkpoints_requeues_and_resumes(slurm, fm_tree, tmp_path, launcher):
    """srun: the signal reaches every rank (each is a task). torchrun: it reaches torchrun, one task per
    node, which forwards it to its ranks."""
    out = tmp_path / "run"
    recipe = tiny_recipe(tmp_path / "r.yaml", "imagefolder", fm_tree, out, schedule={"epochs": 20, "max_steps": 300},
                         checkpoint={"keep_last": 2})
    log = tmp_path / "job.out"
    script = REPO / "slurm" / "convit_b_plus.sh"
    assert "#SBATCH --signal=USR1@" in script.read_text() and "#SBATCH --requeue" in script.read_text()
    job = slurm.sbatch("--nodes=2", *CPU_SBATCH, f"--output={log}", str(script),
                       env=_env(recipe, out, fm_tree, LAUNCHER=launcher), cwd=REPO)
    t0 = time.time()
    while len(records(out)) < 3:  # training is under way
        assert time.time() - t0 < 240, log.read_text()[-3000:] if log.exists() else "no log"
        time.sleep(0.5)
    # Slurm's pre-timeout signal (--signal=USR1@T) reaches every task of the step: send the same now.
    slurm.run("scancel", "--signal=USR1", str(job))
    t0 = time.time()
    while not records(out, "stopped"):
        assert time.time() - t0 < 120, log.read_text()[-3000:]
        time.sleep(0.5)
    stopped_at = records(out, "stopped")[0]["step"]
    info = slurm.wait_job(job, timeout=600)
    text = log.read_text()
    assert info["JobState"] == "COMPLETED", text[-4000:]
    assert info.get("Restarts") == "1", info
    assert "requeueing job" in text and "restart 1" in text  # --open-mode=append keeps both runs
    assert f"launcher {launcher}" in text
    if launcher == "torchrun":  # torchrun handled USR1 (by default it would die of it) and waited for its ranks
        assert "death signal, shutting down workers" in text and "closing signal SIGUSR1" in text
    assert f"resumed from {out}/checkpoints/step_{stopped_at:09d} at step {stopped_at}" in text
    end = records(out, "end")
    assert len(end) == 1 and end[0]["step"] == 300
    steps = [r["step"] for r in records(out)]
    assert steps == list(range(1, 301))  # no step lost or repeated across the requeue
    meta = json.loads((out / "checkpoints" / "step_000000300" / "meta.json").read_text())
    assert meta["reason"] == "end"
