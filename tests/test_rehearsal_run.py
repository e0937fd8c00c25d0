"""The rehearsal's parts that run in seconds (convit_scale/rehearsal/run.py): the job shapes it reads from the Slurm
scripts, its refusals, its recipe, and its checks on two jobs' records. Its local cluster is tested in
test_rehearsal_cluster.py; the rehearsal itself (32 ranks, about 8 minutes) is `make rehearsal`, not in the suite."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
from support import REPO

from convit_scale.rehearsal.run import JobShape, Watch, checks, figures, main, read_script


@pytest.mark.parametrize("script, nodes", [("convit_b_plus.sh", 4), ("deit_b_plus.sh", 4), ("convit_b.sh", 2)])
def test_the_job_shape_is_the_scripts_own(script, nodes):
    shape = read_script(REPO / "slurm" / script)
    assert (shape.nodes, shape.tasks_per_node, shape.world) == (nodes, 8, nodes * 8)
    assert shape.signal.startswith("USR1@") and shape.recipe.startswith("recipes/table1/")


@pytest.mark.parametrize("argv, error", [
    (["--script", "slurm/none.sh"], f"error: --script {REPO}/slurm/none.sh: no such file; allowed: one of slurm/*.sh"),
    (["--script", "slurm/launch.sh"], f"error: --script {REPO}/slurm/launch.sh: no nodes, ntasks-per-node, signal, "
                                      f"RECIPE in it; allowed: a slurm/*.sh wrapper of launch.sh with #SBATCH --nodes, "
                                      f"--ntasks-per-node and --signal"),
    (["--signal-at", "8"], "error: --signal-at 8: allowed: 1 <= --signal-at < --steps (8)"),
    (["--requeue-nodes", "5"], "error: --requeue-nodes 5: allowed: 1 to the script's 4 nodes"),
    (["data.num_workers=2"], "error: override 'data.num_workers=2': allowed: parallel.KEY=VALUE (the layout; the rest "
                             "is the rehearsal's)"),
])
def test_bad_input_is_one_line_before_any_work(argv, error, capsys, tmp_path):
    assert main([*argv, "--out", str(tmp_path / "out")]) == 2
    assert capsys.readouterr().err == error + "\n"
    assert not (tmp_path / "out").exists()


def _job(out, losses, restarts, ranks, stop_at=None, lost=0, world=4, world_after=None):
    """A job as the rehearsal's watch sees it: the records with the times they appeared, the job's state and its
    ranks' (rank, local rank, node id, node name); metrics.jsonl as the engine leaves it. Stopped after step
    ``stop_at``, having trained ``lost`` steps past its checkpoint, which the resumed run trains again on
    ``world_after`` ranks (default: ``world``)."""
    from convit_scale.metrics import MetricsWriter

    w = Watch(slurm=None, job=1, out=out, recipe=out / "r.yaml")
    w.state = {"JobState": "COMPLETED", "Restarts": str(restarts)}
    w.ranks = {str(100 + i): r for i, r in enumerate(ranks)}
    w.events = {"submitted": 0.0, "running": 1.0}
    train = lambda t, step, n=world: (t, {"kind": "train", "step": step, "loss": losses[step - 1],  # noqa: E731
                                          "peak_mem_mb": [1.0] * n})
    t, n = 10.0, world
    for step in range(1, len(losses) + 1):
        if step == (stop_at or 0) + 1:  # the signal, the checkpoint, the requeue, the restart
            w.records += [train(t + 0.1 * k, step + k) for k in range(lost)]
            w.records.append((t, {"kind": "stopped", "step": stop_at}))
            w.events.update(signal=t - 0.5, published=t + 1, requeued=t + 3, restarted=t + 10, first_new_step=t + 20)
            t, n = t + 20, world_after or world
        w.records.append(train(t, step, n))
        t += 1
    w.records.append((t, {"kind": "eval", "step": len(losses), "samples": 200}))
    out.mkdir(parents=True)
    writer = MetricsWriter(out, True, False)
    for t, rec in w.records:  # the resumed run's truncation dropped the steps trained past the checkpoint
        if not (rec["kind"] == "train" and stop_at is not None and rec["step"] > stop_at and t < w.events["restarted"]):
            writer.write(rec)
    writer.close()
    return w


def test_checks_hold_for_a_clean_requeue_and_catch_each_fault(tmp_path):
    """2 nodes x 2 ranks, DDP, 8 steps, stopped after step 3: every check holds, and each fault fails its check."""
    shape = JobShape(REPO / "slurm" / "convit_b_plus.sh", "recipes/table1/convit_base_plus.yaml", 2, 2, "USR1@300")
    blocks = [(r, r % 2, r // 2, f"n{r // 2 + 1}") for r in range(4)]
    losses = [2.3 - 0.01 * i for i in range(8)]
    files = [f"rng_rank{r}.pt" for r in range(4)] + [f"dcp/__{r}_0.distcp" for r in range(4)]
    (tmp_path / "job.out").write_text("resumed from .../step_000000003 at step 3 (epoch 1, batch 1; signal): "
                                      "resumed step 3 from 4 rank(s) on 4\n")
    stop = {"path": tmp_path, "meta": {"step": 3, "world_size": 4, "reason": "signal"}, "files": files,
            "log": tmp_path / "job.out"}
    runs = iter(range(100))

    def failing(a_losses=losses, a_ranks=blocks, stop=stop, lost=0, requeue_nodes=None):
        n = next(runs)
        a = _job(tmp_path / f"a{n}", a_losses, 1, a_ranks, stop_at=3, lost=lost,
                 world_after=2 * requeue_nodes if requeue_nodes else None)
        b = _job(tmp_path / f"b{n}", losses, 0, blocks)
        fig = figures(a, b, stop)
        found = checks(shape, {"strategy": "ddp", "hsdp_replicas": 1}, a, b, stop, len(losses), fig["steps_lost"],
                       requeue_nodes)
        return [k for k, v in found.items() if v is not None], fig

    found, fig = failing()
    assert found == []
    assert (fig["signal_to_checkpoint_published_s"], fig["requeue_to_first_new_step_s"], fig["step_s"],
            fig["steps_lost"]) == (1.5, 17.0, 1.0, 0)
    assert failing(a_losses=losses[:5] + [losses[5] + 1e-7] + losses[6:])[0] == [
        "per-step losses equal the uninterrupted job's"]
    assert failing(stop={**stop, "files": files[1:]})[0] == ["every rank saved step 3 (its own files from ranks 0-3)"]
    cyclic = [(r, r // 2, r % 2, f"n{r % 2 + 1}") for r in range(4)]  # srun --distribution=cyclic
    assert failing(a_ranks=cyclic)[0] == ["rank = node x 2 + local rank on every node (srun block layout)"]
    found, fig = failing(lost=1)  # a rank trained step 4 after the checkpoint of step 3
    assert fig["steps_lost"] == 1 and found == ["resumed at the next step, nothing lost or repeated"]
    assert failing(stop={**stop, "log": tmp_path / "none.out"})[0] == [
        'requeued on 2 nodes: "resumed step 3 from 4 rank(s) on 4" logged']


def test_checks_of_a_requeue_onto_fewer_nodes(tmp_path):
    """2 nodes x 2 ranks requeued onto 1 node: the losses after the stop may differ by the reduction order (1e-5
    relative), not before it and not more; the steps after the requeue have 2 ranks, and the log says so."""
    shape = JobShape(REPO / "slurm" / "convit_b_plus.sh", "recipes/table1/convit_base_plus.yaml", 2, 2, "USR1@300")
    blocks = [(r, r % 2, r // 2, f"n{r // 2 + 1}") for r in range(4)]
    losses = [2.3 - 0.01 * i for i in range(8)]
    files = [f"rng_rank{r}.pt" for r in range(4)] + [f"dcp/__{r}_0.distcp" for r in range(4)]
    log = tmp_path / "job.out"
    log.write_text("resumed step 3 from 4 rank(s) on 2\n")
    stop = {"path": tmp_path, "meta": {"step": 3, "world_size": 4, "reason": "signal"}, "files": files, "log": log}
    runs = iter(range(100))

    def failing(a_losses=losses, world_after=2, precision="fp32"):
        n = next(runs)
        a = _job(tmp_path / f"a{n}", a_losses, 1, blocks, stop_at=3, world_after=world_after)
        b = _job(tmp_path / f"b{n}", losses, 0, blocks)
        found = checks(shape, {"strategy": "ddp", "hsdp_replicas": 1, "precision": precision}, a, b, stop,
                       len(losses), 0, requeue_nodes=1)
        return [k for k, v in found.items() if v is not None]

    close = losses[:5] + [losses[5] * (1 + 3e-6)] + losses[6:]  # after the stop, within 1e-5
    assert failing() == [] and failing(close) == []
    within = "per-step losses equal the uninterrupted job's up to the stop, within 1e-05 after it"
    assert failing(losses[:5] + [losses[5] * (1 + 3e-5)] + losses[6:]) == [within]
    assert failing(losses[:1] + [losses[1] * (1 + 3e-7)] + losses[2:]) == [within]  # before the stop: exact
    assert failing(world_after=4) == ["all 4 ranks in every logged step (2 after the requeue)"]
    off = losses[:5] + [losses[5] * (1 + 3e-5)] + losses[6:]  # bf16 rounds each partial sum: 1e-3 after the stop
    assert failing(off, precision="bf16") == []
    assert failing(losses[:5] + [losses[5] * (1 + 3e-3)] + losses[6:], precision="bf16") == [
        "per-step losses equal the uninterrupted job's up to the stop, within 0.001 after it"]


def test_the_recipe_is_the_scripts_own_batch_and_groups(tmp_path):
    """The rehearsal's recipe for slurm/convit_b_plus.sh: ConViT-B+'s global batch 512 in 32 canonical groups, on
    its 32 ranks and on 24 after losing a node (unequal shares: 8 ranks x 2 groups, 16 x 1); 4 steps an epoch of
    training data; FSDP2 as HSDP with one replica per node at each start; checkpoints written beside training, as
    the recipe writes them."""
    from convit_scale.config import load_config
    from convit_scale.rehearsal.run import (
        layout,
        read_script,
        recipe_batch,
        saves_beside_training,
        train_per_class,
        write_recipe,
    )

    shape = read_script(REPO / "slurm" / "convit_b_plus.sh")
    batch = recipe_batch(shape)
    assert batch == (512, 32) and train_per_class(512) * 10 // 512 == 4
    parallel = layout(shape, [])
    assert saves_beside_training(shape)
    r = write_recipe(tmp_path / "r.yaml", tmp_path / "data", tmp_path / "out", parallel, 8, batch,
                     async_save=saves_beside_training(shape))
    cfg = load_config(r, [])
    assert cfg.checkpoint.async_save and cfg.checkpoint.every_epochs == 1
    assert (cfg.data.global_batch_size, cfg.data.groups) == (512, 32) and cfg.parallel.hsdp_per_node
    assert cfg.data.world_size_problem(32) is None and cfg.data.world_size_problem(24) is None
    assert "at most 32 ranks" in cfg.data.world_size_problem(40)


def test_the_command_runs_from_any_folder(tmp_path):
    """`make rehearsal` runs `python -m convit_scale.rehearsal`: a tool of the package, which imports nothing of the
    tests and finds the checkout's slurm/ scripts from any folder."""
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    res = subprocess.run([sys.executable, "-m", "convit_scale.rehearsal", "--help"], capture_output=True, text=True,
                         cwd=tmp_path, env=env)
    assert res.returncode == 0 and "--signal-at" in res.stdout, res.stderr
