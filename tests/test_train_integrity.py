"""Checkpoints checked at resume (train/integrity.py), saves that fail in one line, and one run per folder
(runfolder.py's lease)."""

import json
import os
import shutil
import subprocess
import time

import pytest
from support import REPO, run_many, tiny_recipe, train_here

from convit_scale.runfolder import EXIT_BAD_INPUT, EXIT_STORAGE, LEASE, check_listing, list_files, read_lease

STRATEGIES = ("ddp", "fsdp2", "zero2")

ROOT_ONLY = pytest.mark.skipif(os.geteuid() != 0, reason="mount needs root; the refusal logic is tested with a "
                               "disk_usage reading below the need")


def _damage(ckpt, strategy):
    """A different damage per strategy: a per-rank shard's bytes changed in place (same size), a file gone, a
    file truncated."""
    if strategy == "ddp":
        victim = sorted((ckpt / "dcp").glob("*.distcp"))[-1]
        data = bytearray(victim.read_bytes())
        data[len(data) // 2] ^= 0xFF
        victim.write_bytes(bytes(data))
        return victim.name
    if strategy == "fsdp2":
        victim = sorted((ckpt / "dcp").glob("*.distcp"))[0]
        victim.unlink()
        return victim.name
    victim = sorted((ckpt / "zero").rglob("*optim_states.pt"))[-1]
    with open(victim, "r+b") as f:
        f.truncate(victim.stat().st_size // 2)
    return victim.name


@pytest.mark.slow
def test_a_damaged_newest_checkpoint_of_each_strategy_is_skipped_for_the_previous_one(fm_tree, tmp_path):
    """Two ranks, gloo: a run of each strategy saves steps 1 and 2; step 2 is damaged (a shard's bytes changed, a
    shard gone, a shard truncated); the next start verifies it on both ranks, sets it aside with a faults.jsonl
    record and a log line naming the file, and resumes from step 1."""
    recipes = {s: tiny_recipe(tmp_path / f"{s}.yaml", "imagefolder", fm_tree, tmp_path / s, data={"val_path": ""},
                              parallel={"strategy": s}, checkpoint={"every_steps": 1},
                              log={"analysis_images": 0}) for s in STRATEGIES}
    first = run_many([{"recipe": r, "overrides": ["schedule.max_steps=2"]} for r in recipes.values()],
                     tmp_path / "first")
    assert first == [0, 0, 0], first
    damaged = {}
    for s in STRATEGIES:
        root = tmp_path / s / "checkpoints"
        meta = json.loads((root / "step_000000002" / "meta.json").read_text())
        assert meta["files"] and all(set(r) == {"bytes", "crc32"} for r in meta["files"].values())
        assert not check_listing(root / "step_000000002", meta["files"])  # the listing matches what was written
        damaged[s] = _damage(root / "step_000000002", s)
    second = run_many([{"recipe": r, "overrides": ["schedule.max_steps=3"]} for r in recipes.values()],
                      tmp_path / "second")
    assert second == [0, 0, 0], second
    out = (tmp_path / "second" / "output.txt").read_text()
    for s in STRATEGIES:
        root = tmp_path / s / "checkpoints"
        assert f"checkpoint {root / 'step_000000002'} is damaged: " in out and damaged[s] in out, out[-3000:]
        assert f"resumed from {root / 'step_000000001'} at step 1" in out
        assert (root / "step_000000002.damaged").is_dir()  # kept for the operator
        assert (root / "latest").read_text().strip() == "step_000000003"
        rec = [json.loads(line) for line in (tmp_path / s / "faults.jsonl").read_text().splitlines()]
        assert [r["kind"] for r in rec] == ["checkpoint_damaged"] and damaged[s] in rec[0]["problems"][0]
        assert rec[0]["resumed_from"] == "step_000000001"


def _saved_run(fm_tree, tmp_path, out, steps=2, **sections):
    r = tiny_recipe(tmp_path / f"{out.name}.yaml", "imagefolder", fm_tree, out, data={"val_path": ""},
                    parallel={"strategy": "none"}, checkpoint={"every_steps": 1}, log={"analysis_images": 0},
                    **sections)
    assert train_here(r, f"schedule.max_steps={steps}") == 0
    return r


def test_no_intact_checkpoint_is_one_line_and_eval_export_refuse_a_damaged_one(fm_tree, tmp_path, capsys):
    """Every checkpoint damaged: the start is refused in one line saying so; ``export`` of a damaged checkpoint is
    refused naming the file; ``RUN:latest`` passes over a damaged newest for the intact one."""
    from convit_scale.cli import main
    from convit_scale.trained import run_checkpoint

    out = tmp_path / "run"
    r = _saved_run(fm_tree, tmp_path, out)
    root = out / "checkpoints"
    victim = root / "step_000000002" / "dcp" / "__0_0.distcp"
    data = bytearray(victim.read_bytes())
    data[len(data) // 3] ^= 0x01
    victim.write_bytes(bytes(data))
    capsys.readouterr()
    bad = root / "step_000000002"
    assert main(["export", "--checkpoint", str(bad), "--out", str(tmp_path / "m.safetensors")]) == EXIT_BAD_INPUT
    err = [line for line in capsys.readouterr().err.splitlines() if line.startswith("error:")]
    assert len(err) == 1 and "is damaged: dcp/__0_0.distcp has crc32" in err[0], err
    assert run_checkpoint(f"{out}:latest") == root / "step_000000001"
    (root / "step_000000001" / "rng_rank0.pt").unlink()
    assert train_here(r, "schedule.max_steps=3") == EXIT_BAD_INPUT
    err = [line for line in capsys.readouterr().err.splitlines() if line.startswith("error:")]
    assert len(err) == 1 and f"no intact checkpoint in {root}" in err[0] and "rng_rank0.pt is missing" in err[0], err


# -- storage ---------------------------------------------------------------------------------------------------------
def _errors(text):
    return [line for line in text.splitlines() if line.startswith("error:")]


def test_a_save_that_would_not_fit_is_refused_before_it_starts(fm_tree, tmp_path, capsys, monkeypatch):
    """The free space the file system reports is below what the save needs (the previous checkpoint's size): the
    save is refused before anything is written, in one line naming the path, the bytes needed and free and the last
    good checkpoint; the run ends with EXIT_STORAGE and resumes from that checkpoint once there is room."""
    from collections import namedtuple

    out = tmp_path / "run"
    r = _saved_run(fm_tree, tmp_path, out, steps=1)
    usage = namedtuple("usage", "total used free")
    real = shutil.disk_usage
    monkeypatch.setattr(shutil, "disk_usage", lambda p: usage(10**9, 10**9 - 1000, 1000) if str(p).startswith(
        str(out)) else real(p))
    capsys.readouterr()
    assert train_here(r, "schedule.max_steps=3") == EXIT_STORAGE
    err = _errors(capsys.readouterr().err)
    root = out / "checkpoints"
    assert len(err) == 1, err
    assert (f"checkpoint at step 2 into {root}: refused before it started: it would not fit" in err[0]
            and "1000 bytes) free" in err[0] and f"the last good checkpoint is {root / 'step_000000001'}" in err[0])
    assert sorted(p.name for p in root.iterdir()) == ["latest", "step_000000001"]  # nothing half-written
    monkeypatch.setattr(shutil, "disk_usage", real)
    assert train_here(r, "schedule.max_steps=2") == 0
    assert "resumed from" in capsys.readouterr().out


@ROOT_ONLY
def test_a_full_file_system_ends_the_save_in_one_line_with_the_earlier_checkpoints_resumable(fm_tree, tmp_path,
                                                                                               capsys):
    """A real small file system (tmpfs): the run saves until the disk is full; the save that hits ENOSPC, or is
    refused before it starts, ends every rank with one line, and the earlier checkpoints resume."""
    mnt = tmp_path / "small"
    mnt.mkdir()
    probe = tmp_path / "probe"
    _saved_run(fm_tree, tmp_path, probe, steps=1)
    one = sum(p.stat().st_size for p in (probe / "checkpoints" / "step_000000001").rglob("*") if p.is_file())
    size = int(one * 2.5) + 64 * 1024  # two checkpoints fit (and the run's small files), a third does not
    subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(mnt)], check=True)
    try:
        out = mnt / "run"
        r = tiny_recipe(tmp_path / "small.yaml", "imagefolder", fm_tree, out, data={"val_path": ""},
                        parallel={"strategy": "none"}, checkpoint={"every_steps": 1, "keep_last": 5},
                        log={"analysis_images": 0, "every_steps": 100})
        capsys.readouterr()
        assert train_here(r, "schedule.max_steps=4") == EXIT_STORAGE
        err = _errors(capsys.readouterr().err)
        assert len(err) == 1 and "checkpoint at step 3 into" in err[0] and "free there" in err[0], err
        assert ("would not fit" in err[0] or "no space left" in err[0]) and "step_000000002 (intact)" in err[0]
        root = out / "checkpoints"
        assert [p.name for p in sorted(root.glob("step_*"))] == ["step_000000001", "step_000000002"]
        ckpt = root / "step_000000002"
        assert not check_listing(ckpt, json.loads((ckpt / "meta.json").read_text())["files"])
        shutil.rmtree(root / "step_000000001")  # room again: the run resumes from its newest
        assert train_here(r, "schedule.max_steps=3", "checkpoint.keep_last=1", "checkpoint.every_minutes=auto") == 0
        said = capsys.readouterr().out
        assert f"resumed from {ckpt} at step 2" in said
        assert "checkpoint.every_minutes=auto, checkpoints: checkpoint.every_minutes=" in said  # resolved at set-up
        assert f"s per save, measured in {out}" in said  # from the saves of the earlier start
    finally:
        subprocess.run(["umount", "-l", str(mnt)], check=False)


@ROOT_ONLY
def test_a_save_the_file_system_refuses_is_one_line_and_leaves_nothing_half_written(fm_tree, tmp_path, capsys):
    """A save that passes the estimate but meets a full disk (ENOSPC mid-write: a real tmpfs without inodes left),
    and a save into a
    read-only checkpoints folder (EROFS, a read-only bind mount): one line each, nothing published, the earlier
    checkpoint resumable."""
    mnt = tmp_path / "small"
    mnt.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64m", "tmpfs", str(mnt)], check=True)
    try:
        out = mnt / "run"
        r = _saved_run(fm_tree, tmp_path, out, steps=1)
        root = out / "checkpoints"
        st = os.statvfs(mnt)  # room for bytes, not for files: the lease, one temporary file, two new folders
        used = st.f_files - st.f_ffree
        subprocess.run(["mount", "-o", f"remount,nr_inodes={used + 4}", str(mnt)], check=True)
        capsys.readouterr()
        assert train_here(r, "schedule.max_steps=2") == EXIT_STORAGE
        err = _errors(capsys.readouterr().err)
        assert len(err) == 1 and "checkpoint at step 2 into" in err[0] and "the save failed: no space left" in err[0]
        assert f"the last good checkpoint is {root / 'step_000000001'} (intact)" in err[0], err
        assert sorted(p.name for p in root.iterdir()) == ["latest", "step_000000001"]
        assert train_here(r, "schedule.max_steps=2", "checkpoint.async_save=true") == EXIT_STORAGE  # written beside
        err = _errors(capsys.readouterr().err)  # training: the same line, raised where the run waits for the save
        assert len(err) == 1 and "checkpoint at step 2 into" in err[0] and "the save failed: no space left" in err[0]
        assert "step_000000002.tmp/dcp/" in err[0]  # met by the background write
        assert sorted(p.name for p in root.iterdir()) == ["latest", "step_000000001"]
        subprocess.run(["mount", "-o", "remount,nr_inodes=100000", str(mnt)], check=True)
        ro = tmp_path / "ro"
        shutil.copytree(root, ro)
        subprocess.run(["mount", "--bind", str(ro), str(root)], check=True)
        subprocess.run(["mount", "-o", "remount,ro,bind", str(root)], check=True)
        try:
            assert train_here(r, "schedule.max_steps=2") == EXIT_STORAGE
            err = _errors(capsys.readouterr().err)
            assert len(err) == 1 and "the save failed: read-only file system" in err[0], err
        finally:
            subprocess.run(["umount", str(root)], check=False)
        assert train_here(r, "schedule.max_steps=2") == 0
        assert f"resumed from {root / 'step_000000001'} at step 1" in capsys.readouterr().out
    finally:
        subprocess.run(["umount", "-l", str(mnt)], check=False)


def test_the_launcher_restarts_into_a_storage_failure_at_most_once(tmp_path):
    """``faults end`` after a step that ended with EXIT_STORAGE: a storage fault with the ranks' line; restarted
    once when the run made progress, stopped the second time with the reason."""
    from convit_scale.faults import end, start

    out = tmp_path / "run"
    line = "error: checkpoint at step 9 into /x: the save failed: no space left (/x/y); ..."
    actions = []
    for step in (4, 8):
        start(out, "77", 0, [])
        (out / "checkpoints" / f"step_{step:09d}").mkdir(parents=True)
        (out / "checkpoints" / f"step_{step:09d}" / "meta.json").write_text("{}")
        actions.append(end(out, EXIT_STORAGE, line + "\n", [], 20))
    assert actions == ["restart", "stop"]
    recs = [json.loads(x) for x in (out / "faults.jsonl").read_text().splitlines()]
    assert [r["kind"] for r in recs] == ["storage", "storage"]
    assert recs[0]["how"].startswith("checkpoint at step 9") and "not restarting into it again" in recs[1]["reason"]


# -- one run per folder ----------------------------------------------------------------------------------------------
def test_a_second_training_is_refused_while_the_lease_is_alive(fm_tree, tmp_path, capsys):
    """A training on two ranks runs in the folder (its rank 0 holds the lease and renews it); a second start into
    it is refused in one line naming the holder, before it trains or writes anything."""
    out = tmp_path / "run"
    r = tiny_recipe(tmp_path / "r.yaml", "imagefolder", fm_tree, out, data={"val_path": ""},
                    schedule={"epochs": 50}, parallel={"strategy": "ddp"}, fault={"heartbeat_s": 1.0},
                    log={"analysis_images": 0})
    from support import ranks_cmd

    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
    first = subprocess.Popen(ranks_cmd(r), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
                             start_new_session=True)
    try:
        deadline = time.time() + 120
        while time.time() < deadline and not (out / "metrics.jsonl").is_file():
            assert first.poll() is None, first.stdout.read()[-3000:]
            time.sleep(0.5)
        lease = read_lease(out)
        assert lease is not None and lease["pid"] != os.getpid()
        time.sleep(2.5)
        assert read_lease(out)["time"] > lease["time"]  # renewed by rank 0's watchdog
        capsys.readouterr()
        assert train_here(r) == EXIT_BAD_INPUT
        err = _errors(capsys.readouterr().err)
        assert len(err) == 1 and f"run.output_dir {out} is in use by another training (pid {lease['pid']} on " \
            f"{lease['host']}" in err[0], err
        assert read_lease(out)["pid"] == lease["pid"]  # still the first run's
    finally:
        os.killpg(first.pid, 9)
        first.wait()


def test_a_stale_lease_is_taken_over_and_the_takeover_logged(fm_tree, tmp_path, capsys, monkeypatch):
    """A lease whose heartbeat is older than fault.hang_timeout_s (its node was lost) is taken over; one of the
    same Slurm job (a requeue) at once, however fresh; the lease is gone when the run ends."""
    out = tmp_path / "run"
    out.mkdir()
    r = tiny_recipe(tmp_path / "r.yaml", "imagefolder", fm_tree, out, data={"val_path": ""},
                    parallel={"strategy": "none"}, log={"analysis_images": 0}, schedule={"max_steps": 1},
                    fault={"hang_timeout_s": 60})
    stale = {"host": "lost-node", "pid": 4242, "job": "100", "step": "0", "restart": 0, "time": time.time() - 61}
    (out / LEASE).write_text(json.dumps(stale))
    assert train_here(r) == 0
    assert ("took over the lease of run.output_dir" in capsys.readouterr().out)
    assert not (out / LEASE).exists()
    (out / LEASE).write_text(json.dumps({**stale, "time": time.time()}))  # alive, held by job 100
    assert train_here(r, "schedule.max_steps=2") == EXIT_BAD_INPUT
    assert "Slurm job 100 step 0" in _errors(capsys.readouterr().err)[0]
    monkeypatch.setenv("SLURM_JOB_ID", "100")
    monkeypatch.setenv("SLURM_RESTART_COUNT", "1")
    assert train_here(r, "schedule.max_steps=2") == 0
    assert "a restart of the same Slurm job 100 (restart 1)" in capsys.readouterr().out


def test_listing_names_a_truncated_changed_or_missing_file(tmp_path):
    for name, data in (("a", b"x" * 10), ("b/c", b"y" * 5), ("d", b"z")):
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_bytes(data)
    listing = list_files(tmp_path, ["a", "b/c", "d"])
    assert not check_listing(tmp_path, listing)
    (tmp_path / "a").write_bytes(b"x" * 9)
    (tmp_path / "b" / "c").write_bytes(b"yyyyY")
    (tmp_path / "d").unlink()
    problems = check_listing(tmp_path, listing)
    assert problems[0] == "a has 9 bytes, 10 listed (truncated or changed)" and problems[2] == "d is missing"
    assert problems[1].startswith("b/c has crc32 ") and problems[1].endswith(f", {listing['b/c']['crc32']} listed "
                                                                              f"(damaged)")
    assert check_listing(tmp_path, listing, checksums=False)[1:] == ["d is missing"]


def test_a_failure_of_a_save_raises_alike_on_every_rank_whatever_its_kind(tmp_path):
    """``checkpoint.agree_on_failure`` (every rank, after its part of a save): a storage refusal is StorageError, an
    I/O error is itself, and a failure that is no Exception (DCP's CheckpointException is a BaseException) is a
    RuntimeError from it, which the next save can catch as it catches the others (an interrupt stays one)."""
    import errno

    from convit_scale.train.checkpoint import agree_on_failure
    from convit_scale.train.integrity import StorageError

    class CheckpointException(BaseException):
        pass

    tmp = tmp_path / "step_000000002.tmp"
    agree_on_failure(None, "the save of step 2", tmp_path, tmp, 0, 2)  # nothing failed: nothing raised
    cases = [(OSError(errno.ENOSPC, "No space left on device"), StorageError),
             (OSError(errno.EIO, "Input/output error"), OSError),
             (CheckpointException("rank 0 failed"), RuntimeError), (KeyboardInterrupt(), KeyboardInterrupt)]
    for failure, raised in cases:
        tmp.mkdir(exist_ok=True)
        with pytest.raises(raised) as got:
            agree_on_failure(failure, "the save of step 2", tmp_path, tmp, 0, 2)
        assert type(got.value) is raised or isinstance(got.value, raised), failure
        if raised is RuntimeError:
            assert got.value.__cause__ is failure and "rank 0: CheckpointException" in str(got.value)
