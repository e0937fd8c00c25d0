"""The engine under faults and as a GPU run would execute it: non-finite gradients, collectives per step,
refusals before training, crashes between checkpoints, checkpoints from another configuration."""

import json
import math
import subprocess
import time

import pytest

from conftest import PY, REPO, records, run_cli, run_ranks, tiny_recipe
from convit_scale.train.distributed import free_port

EXACT = {"drop_path_rate": 0.0}
NO_MIX = {"mixup": 0.0, "cutmix": 0.0}


@pytest.mark.slow
@pytest.mark.parametrize("strategy", ["ddp", "fsdp2", "zero2", "zero3"])
def test_inf_gradient_with_finite_loss_leaves_the_state_exactly(fm_tree, tmp_path, strategy):
    """Accumulation 2; rank 0's gradient of step index 2 is made infinite while its loss stays finite. The step
    is skipped and counted on every rank; weights and optimizer state after it are bit-identical to those before
    it (digest per rank), and training goes on."""
    r = tiny_recipe(tmp_path / "r.yaml", "imagefolder", fm_tree, tmp_path / "out", model=EXACT,
                    data={**NO_MIX, "micro_batch_size": 8, "val_path": ""}, parallel={"strategy": strategy},
                    schedule={"max_steps": 4}, log={"debug_digest": True})
    res = run_ranks(r, env={"CONVIT_SCALE_INF_GRAD_AT_STEP": "2"})
    assert res.returncode == 0, res.stderr[-3000:]
    digests = {d["step"]: d["state_digest"] for d in records(tmp_path / "out", "digest")}
    assert sorted(digests) == [1, 2, 3, 4] and all(len(d) == 2 for d in digests.values())
    assert digests[3] == digests[2]  # the bad step changed nothing, on either rank
    assert digests[4] != digests[3] and digests[2] != digests[1]  # good steps do change the state
    train = records(tmp_path / "out")
    assert [t["skipped_steps"] for t in train] == [0, 0, 1, 1]
    assert train[2]["loss"] is None and train[2]["grad_norm"] is None
    assert all(math.isfinite(t["loss"]) and math.isfinite(t["grad_norm"]) for i, t in enumerate(train) if i != 2)
    assert records(tmp_path / "out", "end")[0]["skipped_steps"] == 1


@pytest.mark.slow
@pytest.mark.parametrize("strategy", ["fsdp2"])
def test_a_step_makes_at_most_two_all_reduce_calls(fm_tree, tmp_path, strategy):
    """Gradient accumulation 4: loss, non-finite flags and the stop flag travel in one packed all-reduce."""
    r = tiny_recipe(tmp_path / "r.yaml", "imagefolder", fm_tree, tmp_path / "out",
                    data={"micro_batch_size": 4, "val_path": ""}, parallel={"strategy": strategy},
                    schedule={"max_steps": 3})
    cmd = [PY, "-m", "torch.distributed.run", "--nproc-per-node=2", "--master-addr=127.0.0.1",
           f"--master-port={free_port()}", str(REPO / "tests" / "count_all_reduce.py"), str(tmp_path / "out"),
           "--recipe", str(r)]
    res = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=600, env={"OMP_NUM_THREADS": "1",
                                                                                        **__import__("os").environ})
    assert res.returncode == 0, res.stderr[-3000:]
    assert "accumulation 4 x world 2" in res.stdout
    for rank in (0, 1):
        per_step = json.loads((tmp_path / "out" / f"all_reduce_rank{rank}.json").read_text())
        assert len(per_step) == 3 and all(1 <= n <= 2 for n in per_step), per_step


def test_strategy_none_on_two_ranks_is_refused_before_training(fm_tree, tmp_path):
    r = tiny_recipe(tmp_path / "r.yaml", "imagefolder", fm_tree, tmp_path / "out", parallel={"strategy": "none"})
    res = run_cli("train", "--recipe", str(r), "--nproc-per-node", "2")
    assert res.returncode == 2
    lines = [line for line in res.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error:") and "parallel.strategy = 'none'" in lines[0], res.stderr
    assert not (tmp_path / "out").exists()


@pytest.mark.slow
def test_kill_between_checkpoints_then_resume_logs_every_step_once(fm_tree, tmp_path):
    """kill -9 after the checkpoint of step 2: the steps logged after it are logged again by the resumed run,
    and metrics.jsonl holds each step once."""
    r = tiny_recipe(tmp_path / "r.yaml", "imagefolder", fm_tree, tmp_path / "out", data={"val_path": ""},
                    schedule={"max_steps": 200}, checkpoint={"every_steps": 2, "keep_last": 2})
    proc = subprocess.Popen([PY, "-m", "convit_scale.train", "--recipe", str(r)], cwd=REPO,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    t0 = time.time()
    while not any(t["step"] >= 3 for t in records(tmp_path / "out")):
        assert proc.poll() is None and time.time() - t0 < 300
        time.sleep(0.1)
    proc.kill()
    proc.wait()
    logged = [t["step"] for t in records(tmp_path / "out")]
    ckpt = max(int(p.name.split("_")[1]) for p in (tmp_path / "out" / "checkpoints").glob("step_*") if p.name[5:].isdigit())
    assert max(logged) > ckpt  # steps after the checkpoint were logged and are lost with the crash
    res = run_cli("train", "--recipe", str(r), f"schedule.max_steps={max(logged) + 2}")
    assert res.returncode == 0, res.stderr[-3000:]
    steps = [t["step"] for t in records(tmp_path / "out")]
    assert steps == list(range(1, max(logged) + 3)), steps


@pytest.mark.slow
def test_checkpoint_of_another_strategy_or_global_batch_is_refused(fm_tree, tmp_path):
    r = tiny_recipe(tmp_path / "r.yaml", "imagefolder", fm_tree, tmp_path / "out", data={"val_path": ""},
                    parallel={"strategy": "zero3"}, schedule={"max_steps": 1})
    assert run_cli("train", "--recipe", str(r)).returncode == 0
    config = (tmp_path / "out" / "config.yaml").read_text()
    for override, names in (("parallel.strategy=fsdp2", ("parallel.strategy", "'zero3'", "'fsdp2'")),
                            ("data.global_batch_size=16", ("data.global_batch_size", "32", "16"))):
        res = run_cli("train", "--recipe", str(r), override, "schedule.max_steps=2")
        assert res.returncode == 2, res.stderr[-3000:]
        errors = [line for line in res.stderr.splitlines() if line.startswith("error:")]
        assert len(errors) == 1 and all(n in errors[0] for n in names), res.stderr[-3000:]
        assert "Traceback" not in res.stderr
        assert (tmp_path / "out" / "config.yaml").read_text() == config  # the run folder still describes its checkpoints


@pytest.mark.slow
@pytest.mark.parametrize("fmt", ["wds", "ffcv"])
def test_sigterm_to_the_process_group_with_workers_saves_and_resumes_exactly(fmt, fm_wds, fm_ffcv, tmp_path):
    """As Slurm preempts: SIGTERM to every process of a 2-rank run whose loaders have 2 workers (DataLoader
    worker processes for WebDataset, as for ImageFolder, whose workers test_data_signals checks; ffcv's threads).
    The run finishes its step, saves and exits 75; resumed, it logs every step once, and (WebDataset, where the
    comparison run is paid for; the loaders' own tests compare resumed batches bit for bit for every format) the
    per-step losses of an uninterrupted run."""
    import os
    import signal

    data = {"wds": fm_wds, "ffcv": fm_ffcv}[fmt]
    kw = dict(model=EXACT, data={"num_workers": 2, "val_path": ""})
    r = tiny_recipe(tmp_path / "r.yaml", fmt, data, tmp_path / "out", schedule={"max_steps": 200}, **kw)
    proc = subprocess.Popen([PY, "-m", "convit_scale.cli", "train", "--recipe", str(r), "--nproc-per-node", "2"],
                            cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
    t0 = time.time()
    while len(records(tmp_path / "out")) < 2:
        assert proc.poll() is None and time.time() - t0 < 400, proc.stdout.read()[-3000:]
        time.sleep(0.1)
    os.killpg(proc.pid, signal.SIGTERM)  # the launcher, torchrun, both ranks and their loader workers
    output = proc.communicate(timeout=300)[0]
    assert proc.returncode == 75, output[-3000:]
    (stopped,) = records(tmp_path / "out", "stopped")
    step = stopped["step"]
    assert (tmp_path / "out" / "checkpoints" / f"step_{step:09d}" / "meta.json").is_file()
    res = run_ranks(r, f"schedule.max_steps={step + 2}")
    assert res.returncode == 0, res.stderr[-3000:]
    got = records(tmp_path / "out")
    assert [t["step"] for t in got] == list(range(1, step + 3))
    if fmt == "wds":
        ref = tiny_recipe(tmp_path / "ref.yaml", fmt, data, tmp_path / "ref", schedule={"max_steps": step + 2}, **kw)
        assert run_ranks(ref).returncode == 0
        assert [t["loss"] for t in got] == [t["loss"] for t in records(tmp_path / "ref")]


def test_best_top1_is_recorded_and_survives_a_resume():
    from convit_scale.train.state import TrainState

    state = TrainState()
    assert state.record_eval(0, {"top1": 50.0, "top5": 90.0})["best_top1"] == 50.0
    assert state.record_eval(1, {"top1": 60.0, "top5": 91.0})["best_epoch"] == 1
    after = state.record_eval(2, {"top1": 55.0, "top5": 95.0})
    assert (after["top1"], after["best_top1"], after["best_top5"], after["best_epoch"]) == (55.0, 60.0, 91.0, 1)
    resumed = TrainState.from_meta(state.to_meta(accum=1, world_size=2), accum=1, world_size=2)
    assert resumed.record_eval(3, {"top1": 58.0, "top5": 96.0})["best_top1"] == 60.0


@pytest.mark.slow
def test_sharded_epoch_analysis_on_two_ranks_equals_one_rank(fm_tree, tmp_path):
    """Gating and nonlocality of the epoch: each rank measures its share of the validation images on its own
    device; the reduced result equals the one-process computation on the same weights."""
    got = {}
    for name, strategy, nproc in (("one", "none", "1"), ("two", "ddp", "2")):
        r = tiny_recipe(tmp_path / f"{name}.yaml", "imagefolder", fm_tree, tmp_path / name, model=EXACT,
                        data=NO_MIX, parallel={"strategy": strategy}, schedule={"max_steps": 3})
        res = run_cli("train", "--recipe", str(r)) if nproc == "1" else run_ranks(r)
        assert res.returncode == 0, res.stderr[-3000:]
        (got[name],) = records(tmp_path / name, "analysis")
    one, two = got["one"], got["two"]
    assert one["analysis_images"] == two["analysis_images"] == 200  # the whole (small) validation split
    assert len(one["nonlocality"]) == 3 and all(abs(a - b) < 1e-4 for a, b in zip(one["nonlocality"], two["nonlocality"]))
    assert all(abs(a - b) < 1e-5 for la, lb in zip(one["gating"], two["gating"]) for a, b in zip(la, lb))


def test_a_crash_between_the_two_renames_of_a_same_step_save_loses_nothing(tmp_path):
    """step_N was moved to step_N.old and the crash came before step_N.tmp became step_N: resume finds it."""
    from convit_scale.train.checkpoint import choose_checkpoint

    root = tmp_path / "checkpoints"
    for name, meta in (("step_000000002", True), ("step_000000004.old", True), ("step_000000004.tmp", False),
                       ("step_000000006.tmp", False)):
        (root / name).mkdir(parents=True)
        if meta:
            (root / name / "meta.json").write_text(json.dumps({"step": int(name[5:14])}))
    assert choose_checkpoint(root, "auto") == root / "step_000000004"  # the old one put back, half-written ones gone
    assert sorted(p.name for p in root.iterdir()) == ["step_000000002", "step_000000004"]
    (root / "step_000000004").rename(root / "step_000000004.old")
    (root / "step_000000004.tmp").mkdir()
    (root / "step_000000004.tmp" / "meta.json").write_text("{}")  # the new one was complete: it is published
    assert choose_checkpoint(root, "auto") == root / "step_000000004"
    assert not (root / "step_000000004.old").exists() and (root / "step_000000004" / "meta.json").read_text() == "{}"


def test_zero_state_is_not_resumed_on_another_world_size(tmp_path):
    from convit_scale.train.checkpoint import CheckpointIncompatible, check_compatible

    meta = {"strategy": "zero3", "model": "convit_tiny", "global_batch_size": 32, "world_size": 4}
    expected = {"strategy": "zero3", "model": "convit_tiny", "global_batch_size": 32}
    check_compatible(tmp_path, meta, {**expected, "world_size": 4})
    with pytest.raises(CheckpointIncompatible, match="partitioned over 4 ranks, the run has 2"):
        check_compatible(tmp_path, meta, {**expected, "world_size": 2})
    check_compatible(tmp_path, {**meta, "strategy": "fsdp2"}, {**expected, "strategy": "fsdp2", "world_size": 2})


def test_a_line_torn_by_a_crash_does_not_block_reading_or_resuming(tmp_path):
    from convit_scale.metrics import read_records, truncate_after

    (tmp_path / "metrics.jsonl").write_text('{"kind": "train", "step": 1}\n{"kind": "train", "step": 2}\n{"kind": "tr')
    assert [r["step"] for r in read_records(tmp_path, "train")] == [1, 2]
    truncate_after(tmp_path, 1)
    assert [r["step"] for r in read_records(tmp_path)] == [1]
