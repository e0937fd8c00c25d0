"""The three commands this project serves, typed as its users type them (README's first screen, docs/cluster.md):
converting an ImageNet-layout tree into FFCV files (`convit-scale prep ffcv`), `accelerate launch` as the docs give it,
and `sbatch slurm/convit_b_plus.sh` on a local Slurm cluster of the script's own shape (4 nodes x 8 GPUs, 10 CPUs per
task). Only the environment the scripts and docs document changes: the tests' small data (DATA_DIR, data paths),
OVERRIDES to shrink the model, and a loopback rendezvous address (the cluster's nodes are this host)."""

from __future__ import annotations

import os
import re
import shlex
import subprocess
from pathlib import Path

import pytest
from support import REPO, records, run_group

from convit_scale.train.distributed import free_port

pytestmark = pytest.mark.slow

BIN = REPO / ".venv" / "bin"
# A CPU-sized model on 28x28 Fashion-MNIST in place of the recipe's ImageNet model; the rest is the recipe's.
SMALL = ["model.name=convit_nano", "model.num_classes=10", "model.img_size=28", "model.patch_size=7",
         "data.num_workers=1", "parallel.precision=fp32", "log.every_steps=1", "schedule.max_steps=2"]
# 1,000 images make one step of 512 an epoch (each with its evaluation): one step at 32 ranks
ONE_STEP = [o if o != "schedule.max_steps=2" else "schedule.max_steps=1" for o in SMALL]


def _shell(line: str, env: dict, timeout: float) -> subprocess.CompletedProcess:
    """``line`` run by bash in the repository root, as typed, with the venv's commands first on PATH."""
    env = {**os.environ, **env, "PATH": f"{BIN}{os.pathsep}{os.environ['PATH']}"}
    return run_group(["bash", "-c", line], timeout=timeout, env=env)


@pytest.fixture(scope="module")
def imagenet_ffcv(fm_tree, tmp_path_factory) -> Path:
    """What README's first command makes of an ImageNet-layout tree (train/ and val/ of class folders of JPEGs)."""
    out = tmp_path_factory.mktemp("users") / "imagenet-ffcv"
    res = _shell(f"convit-scale prep ffcv --src {fm_tree} --out {out}", {}, timeout=600)
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-3000:]
    return out


def test_prep_ffcv_converts_an_imagenet_tree(imagenet_ffcv):
    assert sorted(p.name.split("_")[0] for p in imagenet_ffcv.glob("*.beton")) == ["train", "val"]
    assert (imagenet_ffcv / "manifest.json").is_file()
    res = _shell(f"convit-scale prep verify {imagenet_ffcv}", {}, timeout=300)
    assert res.returncode == 0, res.stdout + res.stderr


def test_accelerate_launch_as_the_docs_give_it(imagenet_ffcv, tmp_path):
    line = next(ln for ln in (REPO / "docs" / "cluster.md").read_text().splitlines()
                if ln.startswith("accelerate launch --config_file recipes/accelerate/single_node.yaml"))
    doc = (line.rstrip("\\ ") + " " + next_line(line)).replace("data.train_path=...", "").replace(
        "data.val_path=...", "")
    assert "-m convit_scale.train --recipe recipes/table1/convit_small_plus.yaml" in doc
    # the docs' --num_processes for another process count than the node's 8 GPUs; ACCELERATE_USE_CPU: no GPU here
    port = free_port()
    typed = doc.replace("accelerate launch ", f"accelerate launch --num_processes 2 --main_process_port {port} ", 1)
    out = tmp_path / "run"
    typed += " " + shlex.join([f"data.train_path={imagenet_ffcv}", f"data.val_path={imagenet_ffcv}",
                               f"run.output_dir={out}", *SMALL])
    res = _shell(typed, {"ACCELERATE_USE_CPU": "true", "OMP_NUM_THREADS": "1"}, timeout=600)
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-3000:]
    assert "strategy fsdp2 | 2 rank(s) on cpu (gloo, launched by accelerate)" in res.stdout  # the recipe's FSDP2
    assert "global batch 512" in res.stdout  # the recipe's, whatever launches it
    assert [r["step"] for r in records(out)] == [1, 2]
    assert "the paper's Table" not in res.stdout  # another model (SMALL) than the recipe's paper row


def next_line(line: str) -> str:
    lines = (REPO / "docs" / "cluster.md").read_text().splitlines()
    return lines[lines.index(line) + 1].strip()


@pytest.mark.slurm
def test_sbatch_convit_b_plus_as_typed(fm_wds, tmp_path):
    """`DATA_DIR=... sbatch slurm/convit_b_plus.sh` from the repository root, on 4 nodes of 8 GPUs and 80 CPUs: 32
    ranks, the recipe's global batch of 512, trained, evaluated, and the log where the script puts it. The data are
    WebDataset shards, as README says (`OVERRIDES=data.format=wds`): an FFCV loader compiles its stages with numba
    in every rank, minutes of CPU for 32 ranks on 2 cores."""
    from convit_scale.rehearsal.cluster import LocalSlurm, missing_requirements

    why = missing_requirements()
    if why:
        pytest.fail(f"cannot start the local Slurm cluster: {why}")
    slurm = LocalSlurm(tmp_path / "slurm", nodes=4, cpus=80, gpus=8).start()
    out = tmp_path / "run"
    env = {**slurm.env, "DATA_DIR": str(fm_wds), "OUTPUT_DIR": str(out), "OVERRIDES": " ".join(["data.format=wds",
                                                                                                  *ONE_STEP]),
           "MASTER_ADDR": "127.0.0.1"}
    log = None
    try:
        res = _shell("sbatch slurm/convit_b_plus.sh", env, timeout=60)
        assert res.returncode == 0, res.stderr
        job = int(res.stdout.split()[-1])  # "Submitted batch job N"
        log = REPO / f"slurm-convit_b_plus-{job}.out"
        info = slurm.wait_job(job, timeout=900)
        text = log.read_text()
    finally:
        slurm.stop()
        if log is not None:
            log.unlink(missing_ok=True)
    assert info["JobState"] == "COMPLETED", text[-4000:]
    assert "== nodes 4, tasks/GPUs per node 8, launcher srun" in text
    assert "model:" in text  # the resolved recipe is printed at the top of the log
    assert "32 rank(s) on cpu" in text and "global batch 512 = micro 16 x accumulation 1 x world 32" in text
    # 80 CPUs configured per node over this machine's few cores: each rank's share of the cores in OpenMP threads,
    # not the 10 of --cpus-per-task (320 spinning threads on 2 cores)
    cores = int(re.search(r"OpenMP threads \d+: (\d+) core\(s\) on this node for 8 rank\(s\)", text).group(1))
    assert f"OMP_NUM_THREADS={max(1, cores // 8)}\n" in text and cores // 8 < 10
    assert [r["step"] for r in records(out)] == [1]
    assert records(out, "eval")[-1]["samples"] == 200  # the whole val split, once
