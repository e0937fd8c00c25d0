"""recipes/accelerate/*.yaml: one config per launch shape (the recipe chooses the strategy), and multi_node.yaml
taking the node count, rank and main address from the command line built from the environment."""

from __future__ import annotations

import os
import subprocess

import pytest
import yaml
from support import REPO, records, tiny_recipe

CONFIGS = REPO / "recipes" / "accelerate"


def _accelerate_bin() -> str:
    local = REPO / ".venv" / "bin" / "accelerate"
    return str(local) if local.exists() else "accelerate"


def test_configs_only_start_processes_and_differ():
    from accelerate.commands.config.config_args import ClusterConfig

    bodies = {}
    for path in sorted(CONFIGS.glob("*.yaml")):
        cfg = ClusterConfig.from_yaml_file(str(path))  # accelerate's own reader: no unknown key
        assert cfg.distributed_type.value == "MULTI_GPU" and cfg.mixed_precision == "no", path.name
        body = yaml.safe_load(path.read_text())
        assert body not in bodies.values(), f"{path.name} is the same config as {list(bodies)}"
        bodies[path.name] = body
    assert {"single_node.yaml", "multi_node.yaml", "cpu_2proc.yaml"} <= set(bodies)
    multi = bodies["multi_node.yaml"]
    assert multi["num_processes"] == -1  # accelerate refuses to start without --num_processes
    assert not {"num_machines", "machine_rank", "main_process_ip", "main_process_port"} & set(multi)


@pytest.mark.slow
def test_multi_node_config_trains_on_two_nodes_from_the_environment(fm_tree, tmp_path):
    """Two "nodes" on this machine, each started with the command line of multi_node.yaml's comment, its values
    from the environment (NNODES, NODE_RANK, MASTER_ADDR, MASTER_PORT, GPUS_PER_NODE)."""
    from convit_scale.train.distributed import free_port

    out = tmp_path / "out"
    r = tiny_recipe(tmp_path / "r.yaml", "imagefolder", fm_tree, out, parallel={"strategy": "ddp"},
                    model={"drop_path_rate": 0.0}, data={"mixup": 0.0, "cutmix": 0.0}, schedule={"max_steps": 2})
    command = ('"$ACCELERATE" launch --config_file recipes/accelerate/multi_node.yaml '
               '--num_machines "$NNODES" --machine_rank "$NODE_RANK" --num_processes "$((NNODES * GPUS_PER_NODE))" '
               '--main_process_ip "$MASTER_ADDR" --main_process_port "$MASTER_PORT" '
               '-m convit_scale.train --recipe "$RECIPE"')
    env = {**os.environ, "ACCELERATE": _accelerate_bin(), "ACCELERATE_USE_CPU": "true", "OMP_NUM_THREADS": "1",
           "NNODES": "2", "GPUS_PER_NODE": "1", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()),
           "RECIPE": str(r)}
    nodes = [subprocess.Popen(["bash", "-c", command], cwd=REPO, env={**env, "NODE_RANK": str(rank)},
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for rank in (0, 1)]
    results = [node.communicate(timeout=600) for node in nodes]
    assert [n.returncode for n in nodes] == [0, 0], [e[-3000:] for _, e in results]
    assert "strategy ddp | 2 rank(s) on cpu (gloo, launched by accelerate)" in results[0][0]
    assert [rec["step"] for rec in records(out)] == [1, 2]


def test_multi_node_config_without_the_command_line_values_is_refused(tmp_path):
    res = subprocess.run([_accelerate_bin(), "launch", "--config_file", str(CONFIGS / "multi_node.yaml"),
                          "-m", "convit_scale.train", "--recipe", "R.yaml"], capture_output=True, text=True,
                         cwd=tmp_path, timeout=300, env={**os.environ, "ACCELERATE_USE_CPU": "true"})
    assert res.returncode != 0 and "You need to manually pass in `--num_processes`" in res.stderr, res.stderr[-2000:]
