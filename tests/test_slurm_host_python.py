"""slurm/launch.sh on a container site: the batch shell's own Python (HOST_PYTHON, the host's python3) cannot import
torch, and the ranks' Python (PYTHON, /opt/image/bin/python) exists only inside the srun steps. Every check before
training (the recipe's run folder, the world size, torchrun's options) must run in a one-task srun step, and the fault
bookkeeping between steps must need nothing but the standard library. Runs without the Slurm cluster: srun and
scontrol are stand-ins that log each call, run the checks with the real interpreter (as the container would) and end
the training step with a chosen status."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from support import REPO

SRUN = r"""#!/usr/bin/env bash
printf '%s\n' "$(printf '%s ' "$@" | tr '\n' ' ')" >> "$FAKE_LOG"
while [ $# -gt 0 ] && [[ "$1" == -* ]]; do shift; done   # srun's options (all --opt=value here)
export FAKE_IN_SRUN=1
[ "${1:-}" = /opt/image/bin/python ] && set -- "$CONTAINER_PY" "${@:2}"   # the image's interpreter, inside the step
case "$*" in *"-m convit_scale.train"*|*"-m torch.distributed.run"*) exit "${FAKE_TRAIN_RC:-0}" ;; esac
exec "$@"
"""
SCONTROL = r"""#!/usr/bin/env bash
case "$1 $2" in
    "show hostnames") echo localhost ;;
    "show node") echo "NodeName=localhost State=IDLE" ;;
esac
"""


def _exe(path, text):
    path.write_text(text)
    path.chmod(0o755)
    return path


@pytest.fixture
def site(tmp_path, fm_wds):
    """A fake srun/scontrol on PATH, a ranks' Python that refuses to run outside srun, a host python3 without torch."""
    bin_dir, no_torch = tmp_path / "bin", tmp_path / "no_torch"
    bin_dir.mkdir()
    no_torch.mkdir()
    for module in ("torch", "timm", "numpy", "deepspeed"):
        (no_torch / f"{module}.py").write_text(f"raise ImportError('no {module} on this host')\n")
    _exe(bin_dir / "srun", SRUN)
    _exe(bin_dir / "scontrol", SCONTROL)
    container_py = _exe(tmp_path / "container-python", f"""#!/bin/sh
[ "$FAKE_IN_SRUN" = 1 ] || {{ echo "PYTHON ran in the batch shell: $*" >&2; exit 99; }}
exec {sys.executable} "$@"
""")
    host_py = _exe(bin_dir / "python3", f"""#!/bin/sh
echo "$*" >> {tmp_path / "host.log"}
PYTHONPATH={no_torch}${{PYTHONPATH:+:$PYTHONPATH}} exec {sys.executable} "$@"
""")
    site_sh = tmp_path / "site.sh"
    site_sh.write_text('SRUN_ARGS="--container-image=/images/convit.sqsh --container-workdir=$PWD"\n')
    env = {"PATH": f"{bin_dir}:{os.environ['PATH']}", "HOME": str(tmp_path), "SLURM_SUBMIT_DIR": str(REPO),
           "SLURM_JOB_ID": "4242", "SLURM_JOB_NAME": "t", "SLURM_JOB_NODELIST": "localhost", "SLURM_JOB_NUM_NODES": "1",
           "SLURM_NTASKS_PER_NODE": "2", "SLURM_CPUS_PER_TASK": "1", "SITE_SCRIPT": str(site_sh),
           "PYTHON": "/opt/image/bin/python", "CONTAINER_PY": str(container_py), "HOST_PYTHON": str(host_py),
           "FAKE_LOG": str(tmp_path / "srun.log"),
           "RECIPE": "recipes/cpu/demo.yaml", "OVERRIDES": f"run.output_dir={tmp_path / 'run'}",
           "DATA_DIR": str(fm_wds)}  # checked before srun, inside the check's srun step
    return tmp_path, env


def _launch(env, **more):
    return subprocess.run(["bash", str(REPO / "slurm" / "launch.sh")], cwd=REPO, env={**env, **more},
                          capture_output=True, text=True, timeout=300)


def test_the_host_python_cannot_import_torch(site):
    _, env = site
    r = subprocess.run([env["HOST_PYTHON"], "-c", "import torch"], env=env, capture_output=True, text=True)
    assert r.returncode == 1 and "no torch on this host" in r.stderr


@pytest.mark.slow
@pytest.mark.parametrize("launcher", ["srun", "torchrun"])
def test_checks_run_in_srun_steps_and_the_bookkeeping_without_torch(site, launcher):
    """A training step that crashes (status 1): the checks ran inside srun, the batch shell's fault bookkeeping wrote
    its records with a torch-less python3, and the job ends with the step's status (no progress: no restart)."""
    tmp_path, env = site
    r = _launch(env, LAUNCHER=launcher, FAKE_TRAIN_RC="1")
    out = r.stdout + r.stderr
    assert "PYTHON ran in the batch shell" not in out and "Traceback" not in out, out
    assert r.returncode == 1, out
    calls = (tmp_path / "srun.log").read_text().splitlines()
    checks = [c for c in calls if "--ntasks=1" in c]
    assert any("config --recipe recipes/cpu/demo.yaml --get run.output_dir" in c for c in checks), calls
    assert any("--world-size 2" in c and f"--check-data DATA_DIR={env['DATA_DIR']}" in c for c in checks), calls
    assert all("--container-image=/images/convit.sqsh" in c for c in calls), calls
    if launcher == "torchrun":
        assert any("torch.distributed.run import get_args_parser" in c for c in checks), calls
    records = [json.loads(line) for line in (tmp_path / "run" / "faults.jsonl").read_text().splitlines()]
    assert records[-1]["kind"] == "crash", records
    host_calls = (tmp_path / "host.log").read_text().splitlines()  # the batch shell's python3: faults start, end
    assert any("convit_scale.faults start" in c for c in host_calls), host_calls
    assert any("convit_scale.faults end" in c for c in host_calls), host_calls


@pytest.mark.slow
def test_a_finished_step_ends_the_job_with_status_0(site):
    tmp_path, env = site
    r = _launch(env, FAKE_TRAIN_RC="0")
    assert r.returncode == 0 and "PYTHON ran in the batch shell" not in r.stderr, r.stdout + r.stderr
    assert "training exited with status 0" in r.stdout
