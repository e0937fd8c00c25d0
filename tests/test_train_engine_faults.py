"""The engine under faults and as a GPU run would execute it: collectives per step, refusals before training,
a crash between checkpoints, a preemption's SIGTERM to every process with loader workers."""

import os
import subprocess
import time

import pytest
from support import PY, REPO, records, run_many, tiny_recipe, train_here

EXACT = {"drop_path_rate": 0.0}
NO_MIX = {"mixup": 0.0, "cutmix": 0.0}


def test_a_step_makes_one_all_reduce_call(fm_tree, tmp_path, monkeypatch):
    """Gradient accumulation 4 under FSDP2: loss, non-finite flags, the gradient norm and the stop flag travel in one
    packed all-reduce per step (FSDP2's own reduce-scatter is not an all-reduce). With a process group every
    collective is called, at world size 1 too, so one process counts what each rank of a larger run calls."""
    import torch.distributed as dist

    from convit_scale.train import loop

    calls, per_step = [0], []
    all_reduce, train_step = dist.all_reduce, loop.train_step

    def counting_all_reduce(*args, **kwargs):
        calls[0] += 1
        return all_reduce(*args, **kwargs)

    def counted_step(*args):
        before = calls[0]
        result = train_step(*args)
        per_step.append(calls[0] - before)
        return result

    monkeypatch.setattr(dist, "all_reduce", counting_all_reduce)
    monkeypatch.setattr(loop, "train_step", counted_step)
    r = tiny_recipe(tmp_path / "r.yaml", "imagefolder", fm_tree, tmp_path / "out",
                    data={"micro_batch_size": 8, "val_path": ""}, parallel={"strategy": "fsdp2"},
                    schedule={"max_steps": 3})
    assert train_here(r) == 0
    assert per_step == [1, 1, 1]


def test_strategy_none_on_two_ranks_is_refused_before_training(fm_tree, tmp_path, capsys):
    from convit_scale.cli import main

    r = tiny_recipe(tmp_path / "r.yaml", "imagefolder", fm_tree, tmp_path / "out", parallel={"strategy": "none"})
    assert main(["train", "--recipe", str(r), "--nproc-per-node", "2"]) == 2
    lines = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error:") and "parallel.strategy = 'none'" in lines[0], lines
    assert not (tmp_path / "out").exists()


@pytest.mark.slow
def test_kill_between_checkpoints_then_resume_logs_every_step_once(fm_tree, tmp_path):
    """kill -9 after the checkpoint of step 2: the steps logged after it are logged again by the resumed run,
    and metrics.jsonl holds each step once."""
    r = tiny_recipe(tmp_path / "r.yaml", "imagefolder", fm_tree, tmp_path / "out", data={"val_path": ""},
                    schedule={"max_steps": 200}, checkpoint={"every_steps": 2, "keep_last": 2})
    # each step waits 1 s first (train/debug.py): the kill lands before step 4 and its checkpoint, which a step of
    # milliseconds could reach between the poll that saw step 3 and the kill
    proc = subprocess.Popen([PY, "-m", "convit_scale.train", "--recipe", str(r)], cwd=REPO,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            env={**os.environ, "CONVIT_SCALE_STEP_DELAY_S": "1"})
    t0 = time.time()
    while not any(t["step"] >= 3 for t in records(tmp_path / "out")):
        assert proc.poll() is None and time.time() - t0 < 300
        time.sleep(0.05)
    proc.kill()
    proc.wait()
    logged = [t["step"] for t in records(tmp_path / "out")]
    ckpt = max(int(p.name.split("_")[1]) for p in (tmp_path / "out" / "checkpoints").glob("step_*")
               if p.name[5:].isdigit())
    assert max(logged) > ckpt  # steps after the checkpoint were logged and are lost with the crash
    assert train_here(r, f"schedule.max_steps={max(logged) + 2}") == 0
    steps = [t["step"] for t in records(tmp_path / "out")]
    assert steps == list(range(1, max(logged) + 3)), steps


@pytest.mark.slow
@pytest.mark.parametrize("fmt", ["wds", "ffcv"])
def test_sigterm_to_the_process_group_with_workers_saves_and_resumes_exactly(fmt, fm_wds, fm_ffcv, tmp_path):
    """As Slurm preempts: SIGTERM to every process of a 2-rank run whose loaders have 2 workers (DataLoader
    worker processes for WebDataset, as for ImageFolder, whose workers test_data_signals checks; ffcv's threads).
    The run finishes its step, saves and exits 75; resumed, it logs every step once, and (WebDataset, where the
    comparison run is paid for; the loaders' own tests compare resumed batches bit for bit for every format) the
    per-step losses of an uninterrupted run. FFCV resumes in this process (1 rank: the checkpoint is the run's at
    any world size), which spares two ranks compiling FFCV's pipeline again."""
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
    if fmt == "wds":  # the resume, and its comparison run
        runs = [{"recipe": r, "overrides": [f"schedule.max_steps={step + 2}"]},
                {"recipe": tiny_recipe(tmp_path / "ref.yaml", fmt, data, tmp_path / "ref",
                                       schedule={"max_steps": step + 2}, **kw)}]
        assert run_many(runs, tmp_path / "launch") == [0] * len(runs)
    else:
        assert train_here(r, f"schedule.max_steps={step + 2}") == 0
    got = records(tmp_path / "out")
    assert [t["step"] for t in got] == list(range(1, step + 3))
    if fmt == "wds":
        assert [t["loss"] for t in got] == [t["loss"] for t in records(tmp_path / "ref")]
