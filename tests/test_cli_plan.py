"""``convit-scale plan``: the job's shape and CPU cores from its Slurm script (never the machine the plan runs on),
the recommended layout, and the Slurm jobs on it."""

import os
import re
from pathlib import Path

import pytest

from convit_scale.cadence import advice, every_minutes_of, save_s_of
from convit_scale.cli import main
from convit_scale.cli.plan import cpus_per_gpu, slurm_job_of, slurm_jobs
from convit_scale.config import load_config
from convit_scale.planner import plan, recommend


@pytest.fixture
def one_cpu(monkeypatch):
    """This process on one CPU and outside any Slurm allocation: a login node."""
    monkeypatch.delenv("SLURM_CPUS_PER_TASK", raising=False)
    allowed = os.sched_getaffinity(0)
    os.sched_setaffinity(0, {min(allowed)})
    yield
    os.sched_setaffinity(0, allowed)


def test_cpus_per_gpu_come_from_the_job_never_from_this_machine(one_cpu, monkeypatch):
    job = slurm_job_of("recipes/table1/convit_tiny.yaml")
    assert job.path.name == "convit_ti.sh" and (job.nodes, job.gpus_per_node, job.cpus_per_task) == (1, 8, 10)
    assert cpus_per_gpu(None, job) == (10.0, "--cpus-per-task of convit_ti.sh")
    assert cpus_per_gpu(3.0, job) == (3.0, "--cpus-per-gpu")
    assert cpus_per_gpu(None, slurm_job_of("recipes/cpu/demo.yaml")) == (None, "")  # no script runs it: no guess
    monkeypatch.setenv("SLURM_CPUS_PER_TASK", "6")  # inside the job's allocation
    assert cpus_per_gpu(None, job) == (6.0, "SLURM_CPUS_PER_TASK")


def test_plan_without_a_job_does_not_check_the_loader(one_cpu, capsys):
    assert main(["plan", "--recipe", "recipes/table2/deit_small_f0.1.yaml", "--gpu", "h200-141gb"]) == 0
    out = capsys.readouterr().out
    assert "loader: not checked: no Slurm script runs this recipe" in out and "job's shape" not in out
    assert "1 x 8 h200-141gb" in out  # --nodes 1, --gpus-per-node 8 without a script


def test_bad_slurm_cpus_and_flags_are_refused(monkeypatch, capsys):
    monkeypatch.setenv("SLURM_CPUS_PER_TASK", "ten")
    assert main(["plan", "--recipe", "recipes/table1/convit_tiny.yaml"]) == 2
    assert capsys.readouterr().err.strip() == \
        "error: SLURM_CPUS_PER_TASK = 'ten' is not a number; pass --cpus-per-gpu N"
    assert main(["plan", "--slurm-jobs", "--nodes", "2"]) == 2
    assert "not allowed with --slurm-jobs" in capsys.readouterr().err
    assert main(["plan", "--recipe", "recipes/table1/convit_tiny.yaml", "--inter-gbytes-per-s", "0"]) == 2
    assert "--inter-gbytes-per-s: 0 is not allowed: must be > 0" in capsys.readouterr().err


def test_plan_of_the_4x8_job(one_cpu, capsys):
    """ConViT-B+ as `sbatch slurm/convit_b_plus.sh` runs it: 4 x 8 GPUs, 10 CPU cores each, whatever this machine
    has; the recipe's layout is the recommended one, and the layout resharding after forward is slower."""
    assert main(["plan", "--recipe", "recipes/table1/convit_base_plus.yaml", "--gpu", "h200-141gb"]) == 0
    out = capsys.readouterr().out
    assert "the job's shape from slurm/convit_b_plus.sh: 4 node(s) x 8 GPUs" in out
    assert "10 CPU cores per GPU (--cpus-per-task of convit_b_plus.sh)" in out
    for layout in ("ddp", "fsdp2", "fsdp2 no-reshard (recipe)", "hsdp 4x8", "hsdp 4x8 no-reshard", "zero3"):
        assert f"│ {layout} " in out
    assert "recommended: fsdp2 no-reshard, the recipe's layout:" in out
    assert "NVLink 4 360 GB/s, network 40 GB/s (data sheet: 450 and 50" in out
    advised = re.search(r"checkpoints: checkpoint\.every_minutes=(\d+) \(Young/Daly", out).group(1)
    job = next(line for line in out.splitlines() if line.startswith("the job: "))  # saves and evaluations counted
    # by time, not per epoch (an epoch is ~21 s of steps here): saves are a small share of the job, not most of it
    saves = re.search(r"300 evaluations \d+\.\d%.* (\d+) saves (\d+\.\d)%", job)
    assert saves and int(saves.group(1)) < 10 and float(saves.group(2)) < 5, job
    assert "the recipe saves by time only" in job
    assert f"every {advised} min by time (checkpoint.every_minutes=auto: the advice above" in job
    assert main(["plan", "--recipe", "recipes/table1/convit_base_plus.yaml", "--gpu", "h200-141gb",
                 "--inter-gbytes-per-s", "100", "parallel.reshard_after_forward=true"]) == 0
    out = capsys.readouterr().out
    assert "network 100 GB/s" in out  # with more network than the reference node's, HSDP's fewer ring steps win
    assert "recommended: hsdp 4x8 no-reshard (parallel.strategy=fsdp2 parallel.hsdp_replicas=4 " \
           "parallel.reshard_after_forward=false)" in out and "the recipe's fsdp2:" in out


def test_the_multi_node_slurm_jobs_run_the_recommended_layout(capsys):
    """Every multi-node job of slurm/ (Tables 1 and 4) at its script's shape on H200 nodes runs the layout the
    planner recommends: its recipe's own; `plan --slurm-jobs` lists them all."""
    assert main(["plan", "--slurm-jobs", "--gpu", "h200-141gb"]) == 0
    out = capsys.readouterr().out
    assert "The Slurm jobs on h200-141gb" in out and "the teacher's forward is not in the compute" not in out
    jobs = [j for j in slurm_jobs() if j.nodes > 1 and j.recipe.startswith(("recipes/table1/", "recipes/table4/"))]
    assert len(jobs) == 8 and {j.nodes for j in jobs} == {2, 4}
    assert all(j.path.name in out for j in slurm_jobs())
    for job in jobs:
        rows = plan(load_config(job.recipe), job.nodes, job.gpus_per_node, "h200-141gb",
                    cpus_per_gpu=job.cpus_per_task)
        best = recommend(rows)
        own = [r["layout"] for r in rows if r["recipe_layout"]]
        assert best["recipe_layout"], (job.path.name, best["layout"], own)


def test_the_b_plus_job_on_3_of_its_4_nodes_plans_unequal_shares(capsys):
    """24 ranks hold ConViT-B+'s 32 canonical groups unequally (8 ranks x 2, 16 x 1): the step waits for the busiest
    ranks, so its compute is that of 2 nodes (16 ranks x 2 groups of 16 images), not 512 / 24 images a rank."""
    assert main(["plan", "--recipe", "recipes/table1/convit_base_plus.yaml", "--nodes", "3", "--gpus-per-node", "8",
                 "--gpu", "h200-141gb"]) == 0
    out = capsys.readouterr().out
    assert ("note: 24 ranks hold 32 canonical groups unequally: 8 ranks x 2, 16 x 1; step time as for 16 ranks x 2"
            in out) and "recommended: " in out
    cfg = load_config("recipes/table1/convit_base_plus.yaml")
    three, two = (plan(cfg, n, 8, "h200-141gb")[0] for n in (3, 2))
    assert three["compute_s"] == two["compute_s"] and three["micro_batch"] * three["grad_accumulation"] == 32


@pytest.mark.parametrize("nodes", [5, 8])
def test_a_job_shape_the_launcher_refuses_is_refused_with_the_node_counts_that_work(nodes, capsys):
    """Before: 8 x 8 recommended a layout for 64 ranks. The cause is the launcher's: 40 or 64 ranks exceed 32
    canonical groups (each rank holds at least one). The plan refuses what `convit-scale config --world-size` and
    slurm/launch.sh refuse, in one line."""
    assert main(["plan", "--recipe", "recipes/table1/convit_base_plus.yaml", "--nodes", str(nodes),
                 "--gpus-per-node", "8", "--gpu", "h200-141gb"]) == 2
    captured = capsys.readouterr()
    err = captured.err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"error: {nodes} node(s) x 8 GPUs: {nodes * 8} ranks exceed the "
                                               f"32 canonical groups"), err
    assert err[0].endswith("node counts that work with 8 GPUs per node: 1, 2, 3, 4") and "recommended" not in \
        captured.out
    assert main(["plan", "--recipe", "recipes/table1/convit_base_plus.yaml", "--nodes", "2", "--gpus-per-node", "8",
                 "--gpu", "h200-141gb"]) == 0


def test_slurm_jobs_table_from_any_folder(tmp_path, monkeypatch, capsys):
    """Before: the scripts' recipes were read relative to the current folder, so only the checkout's root worked."""
    monkeypatch.chdir(tmp_path)
    assert main(["plan", "--slurm-jobs", "--gpu", "h200-141gb"]) == 0
    assert "convit_b_plus.sh" in capsys.readouterr().out


def test_the_gpu_recipes_save_at_the_interval_plan_advises():
    """Every recipe that saves beside training (the GPU recipes) saves by time at `plan`'s Young/Daly advice for its
    Slurm job's GPUs (checkpoint.every_minutes: auto), the interval the run resolves at set-up."""
    gpu_recipes = [p for p in sorted(Path("recipes").rglob("*.yaml")) if p.parent.name not in ("cpu", "accelerate")
                   and load_config(p).checkpoint.async_save]
    assert len(gpu_recipes) > 30
    for path in gpu_recipes:
        cfg, job = load_config(path), slurm_job_of(str(path))
        gpus = job.nodes * job.gpus_per_node if job else 8
        assert cfg.checkpoint.every_minutes == "auto", path
        advised = advice(save_s_of(cfg.run.output_dir), gpus)["every_minutes"]
        assert every_minutes_of(cfg.checkpoint.every_minutes, cfg.run.output_dir, gpus) == advised, path
