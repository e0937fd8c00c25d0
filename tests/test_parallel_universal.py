"""convit_scale/parallel/universal.py: DeepSpeed's universal conversion of a ZeRO checkpoint, published complete or
not at all, its fragments on node-local disk, and how long the other ranks wait for it."""

from __future__ import annotations

import os
import shutil
import signal
import time

import pytest
import torch
from support import built_strategy, one_rank_group, strategy_step

from convit_scale.parallel.universal import (
    COMPLETE,
    UNIVERSAL,
    conversion_files,
    conversion_wait_s,
    folder_bytes,
    is_converted,
    universal_checkpoint,
    universal_problem,
)

CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def zero_checkpoint(tmp_path_factory):
    """A ZeRO-2 checkpoint of one step (one rank), kept pristine: each test converts a copy."""
    folder = tmp_path_factory.mktemp("zero_checkpoint")
    with one_rank_group(CPU):
        strategy = built_strategy(CPU, "parallel.strategy=zero2")
        strategy_step(strategy, CPU)
        strategy.save(folder)
        strategy.close()
    return folder


def _copy(checkpoint, tmp_path):
    shutil.copytree(checkpoint / "zero", tmp_path / "ckpt" / "zero")
    return tmp_path / "ckpt"


def test_a_zero3_checkpoint_is_converted_only_by_a_deepspeed_that_can():
    """DeepSpeed before 0.19 fails converting ZeRO-3 partitions (0.16.0, 0.17.0): refused with what to do instead."""
    assert universal_problem("zero3", "0.19.8") is None and universal_problem("zero2", "0.16.0") is None
    problem = universal_problem("zero3", "0.17.0+cpu")
    assert "DeepSpeed >= 0.19 (installed: 0.17.0+cpu)" in problem and "resume on the world size" in problem


def test_a_universal_folder_without_the_completion_mark_is_converted_again(zero_checkpoint, tmp_path):
    """A ``universal`` folder is a conversion only with the mark its conversion writes last: one that an interrupted
    publication, or an older release's rename alone, left without it is removed and converted again."""
    ckpt = _copy(zero_checkpoint, tmp_path)
    (ckpt / UNIVERSAL / "zero").mkdir(parents=True)
    (ckpt / UNIVERSAL / "zero" / "optimizer_state.pt").write_bytes(b"half a file")
    out = universal_checkpoint(ckpt)
    assert out == ckpt / UNIVERSAL and is_converted(out)
    torch.load(out / "zero" / "zero" / "optimizer_state.pt", weights_only=False)  # DeepSpeed's, whole
    assert not (out / "zero" / "optimizer_state.pt").exists()  # the half file is gone
    mark = __import__("json").loads((out / COMPLETE).read_text())
    files = [f for f in out.rglob("*") if f.is_file() and f.name != COMPLETE]
    assert mark["files"] == len(files) and mark["bytes"] == sum(f.stat().st_size for f in files)
    assert not (ckpt / (UNIVERSAL + ".tmp")).exists() and not (out / "zero" / "tmp").exists()
    before = (out / COMPLETE).stat().st_mtime_ns
    assert universal_checkpoint(ckpt) == out and (out / COMPLETE).stat().st_mtime_ns == before  # converted once


def test_a_crash_mid_conversion_leaves_nothing_that_looks_complete(zero_checkpoint, tmp_path):
    """A process killed (no Python clean-up) as DeepSpeed writes the merged optimizer state: no ``universal`` folder
    exists, nothing is marked, and the fragments were written to the node-local scratch folder, not beside the
    checkpoint. The next conversion starts over and completes."""
    from deepspeed.checkpoint import ds_to_universal

    ckpt, scratch = _copy(zero_checkpoint, tmp_path), tmp_path / "node_local"
    scratch.mkdir()
    pid = os.fork()
    if pid == 0:  # the child dies where the conversion is furthest along: its last write
        try:
            # A forked child of a process that has run OpenMP work (the fixture's step) hangs in its first parallel
            # region: GNU libgomp's thread pool does not survive a fork. One thread, as torch's loader workers do.
            torch.set_num_threads(1)
            ds_to_universal._save_optimizer_state = lambda *a, **k: os._exit(9)
            universal_checkpoint(ckpt, scratch)
        finally:
            os._exit(1)
    assert os.waitstatus_to_exitcode(_wait_or_kill(pid, 300)) == 9
    assert not (ckpt / UNIVERSAL).exists() and not (ckpt / (UNIVERSAL + ".tmp")).exists()
    assert [f.name for f in scratch.glob("convit-universal-*/universal/zero/tmp")] == ["tmp"]  # the fragments
    out = universal_checkpoint(ckpt, scratch)
    assert is_converted(out) and not (out / "zero" / "tmp").exists()


def _wait_or_kill(pid: int, limit_s: float) -> int:
    """The wait status of child ``pid``; past ``limit_s``, or when the wait is interrupted (the test's timeout), it is
    killed: a hung copy of this test process would outlive the test, holding its pipes to pytest-xdist."""
    deadline = time.monotonic() + limit_s
    try:
        while time.monotonic() < deadline:
            done, status = os.waitpid(pid, os.WNOHANG)
            if done:
                pid = 0
                return status
            time.sleep(0.05)
        pytest.fail(f"the forked conversion did not end within {limit_s:g} s (killed)")
    finally:
        if pid:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)


def test_the_other_ranks_wait_for_the_files_as_well_as_the_bytes(zero_checkpoint):
    """ConViT-B+ (180 parameter tensors) under ZeRO-3 saved on 32 ranks: up to 23,760 files, 475 s of metadata at
    20 ms a file on a shared file system, beside the bytes at 5 MB/s."""
    assert conversion_files(180, 32) == 23_760
    base = 600 + folder_bytes(zero_checkpoint / "zero") / 5e6
    assert conversion_wait_s(zero_checkpoint, 600, 180, 32) == pytest.approx(base + 475.2)
    assert conversion_wait_s(zero_checkpoint, 600, 180, 2) < conversion_wait_s(zero_checkpoint, 600, 180, 32)
