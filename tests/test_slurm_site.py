"""slurm/train.sh, slurm/prep.sh, slurm/eval.sh and the site hook (slurm/site_hook.sh) on the real local Slurm
cluster: any recipe into its own run.output_dir, the site's settings and network variables reaching every rank, the
conversion job, the prep -> train -> eval chain."""

from __future__ import annotations

import json
import os
import subprocess

import pytest
from support import REPO, records, tiny_recipe

from convit_scale.rehearsal.cluster import CPU_SBATCH

VENV_PY = os.environ.get("PYTHON", str(REPO / ".venv" / "bin" / "python"))


def _bash(script: str, tmp_path, **env) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", str(REPO / "slurm" / script)], capture_output=True, text=True, cwd=REPO,
                          env={"PATH": os.environ["PATH"], "SLURM_SUBMIT_DIR": str(REPO), **env}, timeout=60)


@pytest.mark.parametrize("script,env,error", [
    ("train.sh", {}, "error: RECIPE is not set; allowed: a recipe file, e.g. RECIPE=recipes/table3/"
                     "convit_small_plus_b_full.yaml sbatch slurm/train.sh"),
    ("train.sh", {"RECIPE": "r.yaml", "SITE_SCRIPT": "/nonexistent/site.sh"},
     "error: SITE_SCRIPT=/nonexistent/site.sh is not a file; allowed: a bash file of site settings"),
    ("prep.sh", {"SRC": "s", "OUT": "o"}, "error: FORMAT= is not allowed; allowed: ffcv or wds"),
    ("prep.sh", {"FORMAT": "ffcv", "OUT": "o"}, "error: SRC is not set"),
    ("prep.sh", {"FORMAT": "wds", "SRC": "s", "OUT": "o", "VERIFY": "yes"}, "error: VERIFY=yes is not allowed"),
    ("eval.sh", {"DATA_DIR": "d"}, "error: CHECKPOINT is not set; e.g. CHECKPOINT=runs/table1/convit_base_plus:best"),
    ("eval.sh", {"CHECKPOINT": "c"}, "error: DATA_DIR is not set"),
    ("array.sh", {}, "error: RECIPES= is not a folder; allowed: a folder of recipes"),
    ("array.sh", {"RECIPES": "recipes/table3"}, "error: slurm/array.sh runs as a job array; allowed: sbatch "
                                                "--array=0-13 slurm/array.sh (14 recipe(s) in recipes/table3)"),
    ("array.sh", {"RECIPES": "recipes/table3", "SLURM_ARRAY_TASK_ID": "14"},
     "error: array task 14 has no recipe: recipes/table3 holds 14; allowed: --array=0-13"),
    ("array.sh", {"RECIPES": "recipes/table3", "SLURM_ARRAY_TASK_ID": "0", "OUTPUT_DIR": "o"},
     "error: OUTPUT_DIR=o is not allowed with slurm/array.sh"),
])
def test_scripts_refuse_missing_settings_before_anything_runs(script, env, error, tmp_path):
    res = _bash(script, tmp_path, **env)
    assert res.returncode == 2 and res.stdout == "", res
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(error), lines


@pytest.mark.parametrize("python,site,expected", [
    ("/opt/image-only/bin/python", "", "/opt/image-only/bin/python"),  # a container's: kept though the host lacks it
    ("", "PYTHON=/opt/image-only/bin/python3", "/opt/image-only/bin/python3"),  # named by the site script
    ("", "", "python3"),  # no .venv in the submit folder: python3
])
def test_every_script_runs_the_python_the_site_names(python, site, expected, tmp_path):
    """launch.sh, prep.sh and eval.sh take their Python from the site hook: a PYTHON that exists only inside the
    container's srun steps is kept as given, not replaced by the batch shell's python3."""
    (tmp_path / "site.sh").write_text(site + "\n")
    env = {"PATH": os.environ["PATH"], "SITE_SCRIPT": str(tmp_path / "site.sh"),
           **({"PYTHON": python} if python else {})}
    out = subprocess.run(["bash", "-c", f"cd {tmp_path} && source {REPO}/slurm/site_hook.sh && echo \"$PY\""],
                         capture_output=True, text=True, env=env, timeout=30)
    assert out.returncode == 0 and out.stdout.strip() == expected, out.stderr
    for script in ("launch.sh", "prep.sh", "eval.sh"):
        text = (REPO / "slurm" / script).read_text()
        assert "site_hook.sh" in text and "PY=" not in text.replace("HOST_PY=", ""), script


def test_every_shipped_recipe_has_a_run_folder_of_its_own():
    """One run folder per recipe: what the Slurm scripts use by default, as `convit-scale train` does."""
    from convit_scale.config import load_config

    recipes = sorted(p for p in (REPO / "recipes").rglob("*.yaml") if p.parent.name not in ("accelerate", "base"))
    folders = [load_config(str(p), []).run.output_dir for p in recipes]
    assert len(recipes) >= 39 and len(set(folders)) == len(folders)


@pytest.mark.slurm
@pytest.mark.slow
def test_prep_train_eval_chain_with_the_site_settings(slurm, fm_tree, tmp_path):
    """The chain the docs show: slurm/prep.sh converts with the job's CPUs and verifies, slurm/train.sh trains on
    its shards once it has ended well, slurm/eval.sh evaluates the run's best checkpoint after that. No OUTPUT_DIR:
    the run folder is the recipe's run.output_dir (it was runs/<job name>, where a Table 3 recipe submitted with a
    Table 1 script found Table 1's checkpoints). The site file's exported network settings reach every rank (gloo
    really binds to GLOO_SOCKET_IFNAME=lo here) and its SRUN_ARGS reach the step. The batch shell's Python cannot
    import torch (a container site's host): the checks before training run in an srun step."""
    out = tmp_path / "runs" / "table3" / "b_10pct"
    shards = tmp_path / "wds"
    recipe = tiny_recipe(tmp_path / "r.yaml", "wds", shards, out, schedule={"max_steps": 2})
    seen = tmp_path / "ranks.txt"
    notorch = tmp_path / "notorch"
    notorch.mkdir()
    (notorch / "torch.py").write_text("raise ImportError('no torch in the batch shell')\n")
    wrapper = tmp_path / "python.sh"  # PYTHON: records what each process of a step was given, then runs python
    wrapper.write_text(f"#!/bin/bash\nif [ -n \"${{SLURM_STEP_ID:-}}\" ]; then "
                       f"echo \"step=$SLURM_JOB_ID.$SLURM_STEP_ID "
                       f"rank=$SLURM_PROCID gloo=${{GLOO_SOCKET_IFNAME:-}} nccl=${{NCCL_SOCKET_IFNAME:-}}\" >> {seen}\n"
                       f"exec {VENV_PY} \"$@\"; fi\n"
                       f"PYTHONPATH={notorch}${{PYTHONPATH:+:$PYTHONPATH}} exec {VENV_PY} \"$@\"\n")
    wrapper.chmod(0o755)
    site = tmp_path / "site.sh"
    site.write_text(f"export GLOO_SOCKET_IFNAME=lo NCCL_SOCKET_IFNAME=lo\nSRUN_ARGS=--label\nPYTHON={wrapper}\n")
    prep_log = tmp_path / "prep.out"
    prep = slurm.sbatch("--cpus-per-task=2", "--time=15", f"--output={prep_log}", str(REPO / "slurm" / "prep.sh"),
                        env={"FORMAT": "wds", "SRC": str(fm_tree), "OUT": str(shards), "PREP_ARGS": "--shard-size 300",
                             "SITE_SCRIPT": str(site)}, cwd=REPO)
    log = tmp_path / "job.out"
    job = slurm.sbatch(f"--dependency=afterok:{prep}", "--nodes=2", *CPU_SBATCH, f"--output={log}",
                       str(REPO / "slurm" / "train.sh"),
                       env={"RECIPE": str(recipe), "SITE_SCRIPT": str(site), "MASTER_ADDR": "127.0.0.1",
                            # a lone rank's variables in the submitting shell (sbatch exports them) are not the ranks'
                            "RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0"}, cwd=REPO)
    # slurm/eval.sh chained to it: the run's best checkpoint, evaluated once training has ended well
    eval_log = tmp_path / "eval.out"
    evaluation = slurm.sbatch(f"--dependency=afterok:{job}", *CPU_SBATCH, f"--output={eval_log}",
                              str(REPO / "slurm" / "eval.sh"), cwd=REPO,
                              env={"CHECKPOINT": f"{out}:best", "DATA_DIR": str(shards), "SITE_SCRIPT": str(site)})
    assert slurm.wait_job(prep, timeout=300)["JobState"] == "COMPLETED", prep_log.read_text()[-3000:]
    prep_text = prep_log.read_text()
    assert "wds, 2 CPUs" in prep_text
    assert f"verified {shards}: every file matches the manifest, and the manifest matches {fm_tree}" in prep_text
    manifest = json.loads((shards / "manifest.json").read_text())
    assert manifest["options"]["workers"] == 2 and manifest["options"]["shard_size"] == 300
    assert manifest["splits"]["train"]["num_samples"] == 1000
    info = slurm.wait_job(job, timeout=300)
    text = log.read_text()
    assert info["JobState"] == "COMPLETED", text[-3000:]
    assert slurm.wait_job(evaluation, timeout=300)["JobState"] == "COMPLETED", eval_log.read_text()[-3000:]
    result = json.loads((out / "eval-b_10pct-best.json").read_text())
    best = max(records(out, "eval"), key=lambda e: e["top1"])
    assert result["images"] == 200 and result["top1"] == pytest.approx(best["top1"])
    assert result["checkpoint"] == str(out / "checkpoints" / "best") and result["view_from"] == "the checkpoint's"
    assert f"output {out} (the recipe's run.output_dir)" in text
    assert f"== site settings: {site}; srun options: --label" in text
    assert "== network settings passed to the ranks: GLOO_SOCKET_IFNAME=lo NCCL_SOCKET_IFNAME=lo" in text
    assert "0: " in text and "1: " in text  # srun --label: each rank's lines carry its number
    assert [r["step"] for r in records(out)] == [1, 2]
    assert "2 rank(s) on cpu (gloo, launched by srun)" in text
    ranks = [line.split() for line in seen.read_text().splitlines()]
    step = next(r[0] for r in ranks if r[1] == "rank=1")  # the training step: the one with two tasks
    training = [r for r in ranks if r[0] == step]
    assert sorted(r[1] for r in training) == ["rank=0", "rank=1"], ranks
    assert all(r[2:] == ["gloo=lo", "nccl=lo"] for r in training), ranks


@pytest.mark.slurm
@pytest.mark.slow
def test_array_sh_runs_each_recipe_of_a_folder_as_a_task(slurm, fm_tree, tmp_path):
    """A table's recipes as one job array: task i runs the i-th recipe by name, each in its own run folder."""
    folder = tmp_path / "table"
    folder.mkdir()
    outs = [tmp_path / "runs" / name for name in ("a", "b")]
    for out in outs:
        tiny_recipe(folder / f"{out.name}.yaml", "imagefolder", fm_tree, out, data={"val_path": ""},
                    schedule={"max_steps": 1})
    job = slurm.sbatch("--array=0-1", *CPU_SBATCH, f"--output={tmp_path}/task_%a.out", str(REPO / "slurm" / "array.sh"),
                       env={"RECIPES": str(folder), "PYTHON": VENV_PY, "MASTER_ADDR": "127.0.0.1"}, cwd=REPO)
    for task, out in enumerate(outs):
        info = slurm.wait_job(f"{job}_{task}", timeout=300)
        text = (tmp_path / f"task_{task}.out").read_text()
        assert info["JobState"] == "COMPLETED", text[-3000:]
        assert f"== array task {task} of 2: {folder / (out.name + '.yaml')}" in text
        assert [r["step"] for r in records(out)] == [1]
