"""accelerate launch as a launcher (2 CPU processes) for DDP and the harness's FSDP2; its FSDP refused."""

import os
import subprocess

import pytest
from support import REPO, losses, tiny_recipe

from convit_scale.train.distributed import free_port

ACCELERATE_CPU = REPO / "recipes" / "accelerate" / "cpu_2proc.yaml"


def _accelerate(config, recipe, *overrides):
    cmd = [str(REPO / ".venv" / "bin" / "accelerate") if (REPO / ".venv" / "bin" / "accelerate").exists()
           else "accelerate",
           "launch", "--config_file", str(config), "--main_process_port", str(free_port()),
           "-m", "convit_scale.train", "--recipe", str(recipe), *overrides]
    env = {**os.environ, "ACCELERATE_USE_CPU": "true", "OMP_NUM_THREADS": "1"}
    return subprocess.run(cmd, capture_output=True, text=True, cwd=REPO, env=env, timeout=600)


@pytest.mark.slow
@pytest.mark.parametrize("strategy", ["ddp"])  # FSDP2: test_users_commands.py, the docs' accelerate line
def test_accelerate_launch_starts_two_ranks(fm_tree, tmp_path, strategy):
    r = tiny_recipe(tmp_path / "r.yaml", "imagefolder", fm_tree, tmp_path / "out", parallel={"strategy": strategy},
                    model={"drop_path_rate": 0.0}, data={"mixup": 0.0, "cutmix": 0.0}, schedule={"max_steps": 2})
    res = _accelerate(ACCELERATE_CPU, r)
    assert res.returncode == 0, res.stderr[-3000:]
    assert f"strategy {strategy} | 2 rank(s) on cpu (gloo, launched by accelerate)" in res.stdout
    assert len(losses(tmp_path / "out")) == 2


def test_accelerate_fsdp_config_is_refused(fm_tree, tmp_path):
    cfg = tmp_path / "fsdp.yaml"
    cfg.write_text(ACCELERATE_CPU.read_text().replace("distributed_type: MULTI_GPU", "distributed_type: FSDP"))
    r = tiny_recipe(tmp_path / "r.yaml", "imagefolder", fm_tree, tmp_path / "out")
    res = _accelerate(cfg, r)
    assert res.returncode != 0
    assert "the accelerate config asks for FSDP" in res.stderr and "parallel.strategy = 'fsdp2'" in res.stderr
    assert not (tmp_path / "out" / "metrics.jsonl").exists()
