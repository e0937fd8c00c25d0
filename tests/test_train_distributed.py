"""convit_scale/train/distributed.py: the global batch on any world size, and the process group's owner."""

import pytest

from convit_scale.config import load_config
from convit_scale.errors import BadInput
from convit_scale.train.distributed import check_world, solve_batch


def test_global_batch_is_solved_or_refused():
    assert solve_batch(1024, 8, None) == (128, 1)
    assert solve_batch(1024, 8, 32) == (32, 4)
    with pytest.raises(BadInput, match="cannot be split over 3 ranks"):
        solve_batch(1024, 3, None)
    with pytest.raises(BadInput, match="does not divide"):
        solve_batch(1024, 8, 48)


def test_world_checks_name_the_key():
    cfg = load_config(None, ["parallel.strategy=none"])
    with pytest.raises(BadInput, match="parallel.strategy = 'none' on 2 ranks"):
        check_world(cfg, 2)
    six = load_config(None, ["data.global_batch_size=6"])  # 3 canonical groups of 2 (Mixup pairs in a group)
    assert six.data.groups == 3 and check_world(six, 3) == (2, 1) and check_world(six, 1) == (6, 1)
    assert check_world(six, 2) == (4, 1)  # unequal shares: rank 0 holds 2 groups, rank 1 one
    assert check_world(load_config(None, ["data.global_batch_size=6", "data.micro_batch_size=2"]), 2) == (2, 2)
    with pytest.raises(BadInput, match="4 ranks exceed the 3 canonical groups of data.global_batch_size = 6 "
                                         r"\(data.canonical_groups = 3; .*at most 3 ranks$"):
        check_world(six, 4)
    with pytest.raises(BadInput, match="data.micro_batch_size = 3 is not a whole number of canonical groups of 2"):
        check_world(load_config(None, ["data.global_batch_size=6", "data.micro_batch_size=3"]), 1)


def test_canonical_groups_default_and_validation():
    from convit_scale.config import ConfigError, default_groups

    # 16 groups of 64 at the paper's batch 1024 (its 16 GPUs x 64); the "+" recipes' 512 on 32 GPUs name 32
    assert [default_groups(b) for b in (1024, 512, 32, 6, 4, 2, 250, 7)] == [16, 16, 16, 3, 2, 1, 5, 7]
    assert load_config(None, []).data.groups == 16
    with pytest.raises(ConfigError, match="data.canonical_groups = 24 is not allowed; must divide "
                                          "data.global_batch_size = 1024"):
        load_config(None, ["data.canonical_groups=24"])
    with pytest.raises(ConfigError, match="data.canonical_groups = 1024 is not allowed; Mixup/CutMix pair the samples "
                                          "of a group: groups of 1 images are odd"):
        load_config(None, ["data.canonical_groups=1024"])
    assert load_config(None, ["data.canonical_groups=1024", "data.mixup=0", "data.cutmix=0"]).data.groups == 1024


def test_a_jobs_rendezvous_port_stays_below_the_ephemeral_range():
    from pathlib import Path

    from convit_scale.train.distributed import job_port

    ports = {job_port(i) for i in range(0, 100_000, 7)}
    assert min(ports) >= 10000 and max(ports) < 30000 < 32768
    script = (Path(__file__).resolve().parents[1] / "slurm" / "launch.sh").read_text()
    assert "$((10000 + ${SLURM_JOB_ID:-0} % 20000))" in script  # the script's rule is the engine's


def test_a_group_alone_puts_its_launch_variables_back(monkeypatch):
    """A one-process group (a run, a benchmark or a test in this process) sets RANK=0 of WORLD_SIZE=1 and a port;
    once it ends they are gone: a launch from this process afterwards (sbatch, torchrun, a subprocess) inherited
    them, and every task of a 2-rank srun step became a lone rank 0, one of them on a port still held."""
    import os
    import socket

    from convit_scale import comm
    from convit_scale.train.distributed import init_distributed

    keys = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")
    for k in keys:
        monkeypatch.delenv(k, raising=False)
    monkeypatch.setenv("MASTER_ADDR", "kept.example")  # a variable the process had before is restored, not removed
    ctx = init_distributed("gloo", 30)
    try:
        assert (ctx.launcher, ctx.world_size) == ("alone", 1) and os.environ["RANK"] == "0"
    finally:
        comm.destroy()
    assert {k: os.environ.get(k) for k in keys} == {**dict.fromkeys(keys), "MASTER_ADDR": "kept.example"}

    monkeypatch.delenv("MASTER_ADDR")
    with socket.socket() as held:  # the group cannot form (its port is taken): nothing is left behind either
        held.bind(("127.0.0.1", 0))
        held.listen()
        import convit_scale.train.distributed as distributed

        monkeypatch.setattr(distributed, "free_port", lambda: held.getsockname()[1])
        with pytest.raises(Exception):
            init_distributed("gloo", 5)
    assert not any(k in os.environ for k in keys)


def test_one_gpu_per_task_is_detected_with_the_srun_option_that_keeps_nvlink():
    """srun --gpus-per-task=1 (or --gpu-bind=single) gives each rank a CUDA_VISIBLE_DEVICES of one device on a node
    of several: NCCL then has no peer access between the node's ranks. Said, with the option that keeps it; a task
    that sees all of its node's GPUs, or a one-GPU node, is quiet."""
    from convit_scale.train.distributed import one_gpu_per_task

    line = one_gpu_per_task({"CUDA_VISIBLE_DEVICES": "3", "SLURM_GPUS_ON_NODE": "8"})
    assert line is not None and "--gpu-bind=none" in line and "--gpus-per-task" in line and "node's 8" in line
    assert one_gpu_per_task({"CUDA_VISIBLE_DEVICES": "0", "SLURM_JOB_GPUS": "0,1,2,3", "SLURM_GPUS_PER_TASK": "1"})
    assert one_gpu_per_task({"CUDA_VISIBLE_DEVICES": "0,1,2,3", "SLURM_GPUS_ON_NODE": "4"}) is None
    assert one_gpu_per_task({"CUDA_VISIBLE_DEVICES": "0", "SLURM_GPUS_ON_NODE": "1"}) is None
    assert one_gpu_per_task({}) is None
