"""Checkpoints written beside training (checkpoint.async_save) under 2 gloo ranks: DCP's async_save (DDP) and
DeepSpeed's files staged in host memory (ZeRO-2)."""

import json

import pytest
from support import records, run_many, tiny_recipe

from convit_scale.runfolder import check_listing

pytestmark = pytest.mark.slow


def _run(fm_tree, tmp_path, name, async_save, max_steps, resume="auto", strategy="ddp"):
    out = tmp_path / name
    recipe = tiny_recipe(tmp_path / f"{name}.yaml", "imagefolder", fm_tree, out,
                         parallel={"strategy": strategy, "precision": "fp32", "timeout_s": 60},
                         checkpoint={"every_steps": 2, "async_save": async_save, "keep_last": 5, "resume": resume},
                         schedule={"epochs": 2, "warmup_epochs": 1, "max_steps": max_steps})
    return {"recipe": recipe, "overrides": []}, out


def test_async_saves_publish_after_the_write_and_resume_bit_exactly(fm_tree, tmp_path):
    """Per strategy, the same run saving beside training and at once: the same checkpoints published with the same
    files, the same losses; a run resumed from an async save continues as the sync run did."""
    plan, outs = [], {}
    for strategy in ("ddp", "zero2"):
        for name, async_save, steps in (("sync", False, 6), ("async", True, 4), ("async", True, 6)):
            run, outs[strategy, name] = _run(fm_tree, tmp_path, f"{strategy}-{name}", async_save, steps,
                                             strategy=strategy)
            plan.append(run)
    assert run_many(plan, tmp_path / "ranks") == [0] * len(plan)
    for strategy, marker in (("ddp", "dcp/.metadata"), ("zero2", "zero/mp_rank_00_model_states.pt")):
        sync_out, async_out = outs[strategy, "sync"], outs[strategy, "async"]
        names = sorted(p.name for p in (sync_out / "checkpoints").glob("step_*"))
        assert sorted(p.name for p in (async_out / "checkpoints").glob("step_*")) == names, strategy
        assert not list((async_out / "checkpoints").glob("*.tmp"))
        saves = records(async_out, "checkpoint")
        assert any(r["background"] for r in saves) and not any(r["background"]
                                                               for r in records(sync_out, "checkpoint"))
        sync_losses = {r["step"]: r["loss"] for r in records(sync_out)}
        async_losses = {r["step"]: r["loss"] for r in records(async_out)}
        assert async_losses == sync_losses, strategy  # bit-exact: the resumed steps 5 and 6 as well
        meta = json.loads((async_out / "checkpoints" / names[-1] / "meta.json").read_text())
        assert meta["step"] == 6
        for name in names:  # the background publication lists every rank's files, as a save at once does
            ckpt = async_out / "checkpoints" / name
            files = json.loads((ckpt / "meta.json").read_text())["files"]
            assert {marker, "rng_rank0.pt", "rng_rank1.pt"} <= set(files) and not check_listing(ckpt, files)
            sync_files = json.loads((sync_out / "checkpoints" / name / "meta.json").read_text())["files"]
            assert set(files) == set(sync_files), (strategy, name)


def test_a_kill_during_an_async_save_never_publishes_it(fm_tree, tmp_path):
    """Both ranks killed (SIGKILL) while the save of step 4 is in flight, its files written but not yet published
    (a test hook holds rank 0's publication): `latest` stays step 2, the half-done save is no checkpoint, and a start
    into the folder resumes from step 2 to the end."""
    import os
    import signal
    import subprocess
    import time

    import psutil
    from support import ranks_cmd, run_ranks

    run, out = _run(fm_tree, tmp_path, "killed", True, 8)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "CONVIT_SCALE_TEST_PUBLISH": "4:600"}
    proc = subprocess.Popen(ranks_cmd(run["recipe"]), env=env, start_new_session=True,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    written = out / "checkpoints" / "step_000000004.tmp" / "dcp" / ".metadata"
    try:
        deadline = time.monotonic() + 300
        while not written.is_file() and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.2)
        assert written.is_file(), "the save of step 4 was never written"
        time.sleep(1)  # the training thread goes on to the next steps meanwhile
    finally:  # torchrun starts its ranks in sessions of their own: each is killed itself
        ranks = psutil.Process(proc.pid).children(recursive=True)
        for p in ranks:
            p.send_signal(signal.SIGKILL)
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=60)
        psutil.wait_procs(ranks, timeout=10)
    root = out / "checkpoints"
    assert (root / "latest").read_text().strip() == "step_000000002"
    assert not (root / "step_000000004").exists() and not (root / "step_000000004.tmp" / "meta.json").exists()
    res = run_ranks(run["recipe"])
    assert res.returncode == 0, res.stderr[-3000:]
    assert (root / "latest").read_text().strip() == "step_000000008"
    assert "step_000000002 at step 2" in res.stdout + res.stderr  # resumed from the last published save


def test_a_failed_background_save_is_made_again_at_once_and_a_stop_still_saves(fm_tree, tmp_path):
    """The background save of step 2 fails on rank 0's publication (an I/O error, not a storage refusal): no rank
    waits for it past the failure, and every rank knows it at the next step (its packed reduction), not at the next
    save: it is logged and recorded and saved again at once from step 3 (the run goes on to its end, saving step 4
    beside training); after a bad step 3 (a NaN loss) the save waits for good step 4, in place of step 4's save
    beside training; a stop signalled in step 3 makes that save the stop's, which exits for its requeue (75) with
    the stop's checkpoint published. Nothing of step 2 is published."""
    plan, outs = [], {}
    for name, env in (("periodic", {}), ("bad", {"CONVIT_SCALE_NAN_AT_STEP": "2"}),
                      ("stopped", {"CONVIT_SCALE_SIGNAL_AT_STEP": "3:1"})):
        run, outs[name] = _run(fm_tree, tmp_path, name, True, 6)
        plan.append({**run, "env": {"CONVIT_SCALE_TEST_PUBLISH": "2:EIO", **env}})
    assert run_many(plan, tmp_path / "ranks") == [0, 0, 75]
    for name, published, reason, at_once in (("periodic", [3, 4, 6], "retry", 3), ("bad", [4, 6], "pending", 4),
                                             ("stopped", [3], "signal", 3)):
        root = outs[name] / "checkpoints"
        assert sorted(p.name for p in root.glob("step_*")) == [f"step_{s:09d}" for s in published], name  # not 2
        assert (root / "latest").read_text().strip() == f"step_{published[-1]:09d}"
        failed = records(outs[name], "checkpoint_failed")
        assert [(r["step"], r["reason"], r["error"].split(":")[0]) for r in failed] == [(3, reason, "OSError")], \
            failed  # rank 0's
        saves = {r["step"]: (r["reason"], r["background"]) for r in records(outs[name], "checkpoint")}
        assert saves[at_once] == ("signal" if name == "stopped" else "retry", False), saves
        assert name == "stopped" or saves[4] == (("every_steps", True) if at_once == 3 else ("retry", False)), saves
    assert "Input/output error" in (tmp_path / "ranks" / "output.txt").read_text()
