"""The rehearsal's local Slurm cluster (convit_scale/rehearsal/cluster.py): 4 nodes of 8 on a 2-core machine, tasks
placed as srun places them on a real cluster."""

from __future__ import annotations

import pytest
from support import REPO

from convit_scale.rehearsal.cluster import LocalSlurm, missing_requirements


@pytest.mark.slurm
def test_four_nodes_of_eight_run_the_scripts_32_tasks_in_node_blocks(tmp_path):
    """slurmd accepts 8 configured CPUs and 8 count-only GPUs on a 2-core machine, and srun places the script's 32
    tasks as on a real cluster: node k holds ranks 8k..8k+7 with local ids 0-7, so HSDP's shard groups of 8
    consecutive ranks are nodes."""
    why = missing_requirements()
    if why:
        pytest.fail(f"cannot start the local Slurm cluster: {why}")
    slurm = LocalSlurm(tmp_path / "slurm", nodes=4, cpus=8, gpus=8).start()
    try:
        sbatch = "".join(line + "\n" for line in (REPO / "slurm" / "convit_b_plus.sh").read_text().splitlines()
                         if line.startswith("#SBATCH") and "--output" not in line)
        job_file = tmp_path / "job.sh"
        job_file.write_text("#!/bin/bash\n" + sbatch + "srun --cpus-per-task=1 bash -c 'echo $SLURM_PROCID "
                            "$SLURM_NODEID $SLURM_LOCALID $SLURMD_NODENAME $SLURM_GPUS_ON_NODE'\n")
        job = slurm.sbatch("--cpus-per-task=1", f"--output={tmp_path / 'job.out'}", str(job_file))
        info = slurm.wait_job(job, timeout=120)
    finally:
        slurm.stop()
    assert info["JobState"] == "COMPLETED", (tmp_path / "job.out").read_text()
    rows = sorted(tuple(int(x) if x.isdigit() else x for x in line.split())
                  for line in (tmp_path / "job.out").read_text().splitlines())
    assert rows == [(8 * n + local, n, local, f"n{n + 1}", 8) for n in range(4) for local in range(8)]
