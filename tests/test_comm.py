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
