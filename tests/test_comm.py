"""convit_scale/comm.py: the waits that outlast the process group's timeout (real gloo, 2 ranks)."""

import json
import os
import subprocess

from support import REPO, torchrun_cmd


def test_a_patient_group_waits_past_the_process_groups_timeout(tmp_path):
    """Rank 0 works alone more than twice the process group's timeout: the other rank, waiting in a patient group,
    receives its result; waiting in the process group itself, it fails after the timeout."""
    res = subprocess.run(torchrun_cmd(2, str(REPO / "tests" / "comm_wait_check.py"), str(tmp_path)), cwd=REPO,
                         capture_output=True, text=True, timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert all((tmp_path / f"rank{r}.json").is_file() for r in range(2)), res.stderr[-4000:]
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    assert [r["patient"] for r in ranks] == ["converted", "converted"], (ranks, res.stderr[-2000:])
    assert ranks[1]["default"].startswith("error after"), ranks


def test_the_background_saves_group_keeps_its_own_timeout_when_the_steps_is_shortened():
    """After a long phase the run shortens every group's timeout to the steps' (``comm.set_timeout``): not the
    background saves' gloo group, whose collectives wait for the slowest rank's write beside training."""
    import datetime

    import torch
    from support import built_strategy, one_rank_group

    from convit_scale import comm
    from convit_scale.parallel.base import SAVE_GROUP_TIMEOUT_S

    def timeout(group) -> datetime.timedelta:
        return group._get_backend(torch.device("cpu")).options._timeout

    cpu = torch.device("cpu")
    with one_rank_group(cpu):
        strategy = built_strategy(cpu, "parallel.strategy=ddp")
        try:
            group = strategy.background_group()
            assert comm.set_timeout(7)
            default = torch.distributed.distributed_c10d._get_default_group()
            assert timeout(default) == datetime.timedelta(seconds=7)
            assert timeout(group) == datetime.timedelta(seconds=SAVE_GROUP_TIMEOUT_S)
            comm.destroy_group(group)
            assert not comm._patient  # destroyed groups are forgotten
        finally:
            strategy.close()
