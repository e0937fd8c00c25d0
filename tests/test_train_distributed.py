"""convit_scale/train/distributed.py: the global batch on any world size, and the process group's owner."""

import pytest

from convit_scale.config import load_config
from convit_scale.train.distributed import check_world, solve_batch


def test_global_batch_is_solved_or_refused():
    assert solve_batch(1024, 8, None) == (128, 1)
    assert solve_batch(1024, 8, 32) == (32, 4)
    with pytest.raises(ValueError, match="cannot be split over 3 ranks"):
        solve_batch(1024, 3, None)
    with pytest.raises(ValueError, match="does not divide"):
        solve_batch(1024, 8, 48)


def test_world_checks_name_the_key():
    cfg = load_config(None, ["parallel.strategy=none"])
    with pytest.raises(ValueError, match="parallel.strategy = 'none' on 2 ranks"):
        check_world(cfg, 2)
    odd = load_config(None, ["data.global_batch_size=6"])
    with pytest.raises(ValueError, match="Mixup/CutMix need an even micro-batch; 3 per rank"):
        check_world(odd, 2)


def test_a_jobs_rendezvous_port_stays_below_the_ephemeral_range():
    from pathlib import Path

    from convit_scale.train.distributed import job_port

    ports = {job_port(i) for i in range(0, 100_000, 7)}
    assert min(ports) >= 10000 and max(ports) < 30000 < 32768
    script = (Path(__file__).resolve().parents[1] / "slurm" / "launch.sh").read_text()
    assert "$((10000 + ${SLURM_JOB_ID:-0} % 20000))" in script  # the script's rule is the engine's
