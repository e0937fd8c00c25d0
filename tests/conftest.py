"""Shared fixtures: the embedded Fashion-MNIST at test size, converted once per session by data_prep."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from convit_scale.metrics import read_records

REPO = Path(__file__).resolve().parents[1]
PY = sys.executable


# `make test` runs the files on 2 pytest-xdist workers, a file per worker at a time (--dist loadfile: a file's
# module fixtures are built once). The longest files go first so that none starts last and runs alone.
LONGEST_FIRST = ["test_slurm.py", "test_train_engine.py", "test_distill.py", "test_train_elastic.py",
                 "test_train_engine_faults.py",
                 "test_demo.py", "test_planner.py", "test_models.py", "test_planner_comm.py", "test_data.py",
                 "test_data_augment_on.py", "test_launchers.py", "test_data_ffcv.py", "test_data_faults.py"]


def pytest_collection_modifyitems(items):
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # stable: the order within a file is kept


@pytest.fixture(scope="session")
def fm_tree(tmp_path_factory) -> Path:
    """Fashion-MNIST as an ImageNet-style tree: 100 train and 20 val images per class."""
    from data_prep.fashion_mnist import build_tree

    return build_tree(tmp_path_factory.mktemp("fm") / "tree", {"train": 100, "val": 20})


@pytest.fixture(scope="session")
def fm_wds(fm_tree, tmp_path_factory) -> Path:
    from data_prep import PrepOptions, prepare

    out = tmp_path_factory.mktemp("fm_wds")
    prepare(fm_tree, out, PrepOptions(fmt="wds", shard_size=96, workers=2))
    return out


@pytest.fixture(scope="session")
def fm_ffcv(fm_tree, tmp_path_factory) -> Path:
    from data_prep import PrepOptions, prepare

    out = tmp_path_factory.mktemp("fm_ffcv")
    prepare(fm_tree, out, PrepOptions(fmt="ffcv", workers=2))
    return out


def tiny_recipe(path: Path, fmt: str, data_dir: Path, out: Path, **sections) -> Path:
    """A CPU recipe on the embedded data; ``sections`` override whole keys ({'parallel': {...}})."""
    import yaml

    recipe = {
        "model": {"name": "convit_nano", "num_classes": 10, "drop_path_rate": 0.1},
        "data": {"format": fmt, "train_path": str(data_dir), "val_path": str(data_dir), "global_batch_size": 32,
                 "eval_batch_size": 50, "num_workers": 0, "repeated_aug": 1},
        "schedule": {"epochs": 2, "warmup_epochs": 1},
        "parallel": {"strategy": "fsdp2", "precision": "fp32", "timeout_s": 60},
        "log": {"every_steps": 1, "progress": False},
        "run": {"output_dir": str(out)},
    }
    for section, values in sections.items():
        recipe.setdefault(section, {}).update(values)
    path.write_text(yaml.safe_dump(recipe))
    return path


def run_cli(*args: str, env: dict | None = None, timeout: int = 600) -> subprocess.CompletedProcess:
    full_env = {**os.environ, "OMP_NUM_THREADS": "1", **(env or {})}
    return subprocess.run([PY, "-m", "convit_scale.cli", *args], capture_output=True, text=True, env=full_env,
                          timeout=timeout, cwd=REPO)


def run_ranks(recipe: Path, *overrides: str, nproc: int = 2, env: dict | None = None,
              timeout: int = 600) -> subprocess.CompletedProcess:
    """The recipe on ``nproc`` local ranks started by torchrun: ``python -m convit_scale.train``, the entry point
    that torchrun, srun and accelerate launch (rank 0 runs the preflight). The same run as ``convit-scale train
    --nproc-per-node``, without that command's own process, whose start-up (importing torch and timm, ~7 s on
    2 cores) comes before the ranks'; the tests of the command itself (refusals before any process, signals,
    exit statuses) use ``run_cli``."""
    full_env = {**os.environ, "OMP_NUM_THREADS": "1", **(env or {})}
    return subprocess.run(ranks_cmd(recipe, *overrides, nproc=nproc), capture_output=True, text=True, env=full_env,
                          timeout=timeout, cwd=REPO)


def train_here(recipe: Path, *overrides: str, env: dict | None = None) -> int:
    """The recipe on one rank in this process (a one-process gloo group), for what needs no second rank: no
    interpreter start-up. Returns the exit status ``python -m convit_scale.train`` would have; ``env`` is set for
    the run only (fault injection is read at set-up)."""
    from convit_scale.config import load_config
    from convit_scale.train.engine import exit_status

    saved = {k: os.environ.get(k) for k in (env or {})}
    os.environ.update(env or {})
    try:
        return exit_status(load_config(recipe, list(overrides)))
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def run_many(runs: list[dict], folder: Path, nproc: int = 2, timeout: int = 1200) -> list[int]:
    """Several runs ({"recipe", "overrides", "env"}) one after another in one launch of ``nproc`` ranks
    (tests/rank_runs.py): the ranks start once for all of them. Returns each run's exit status; their log lines are
    in ``folder/output.txt``."""
    import json

    folder.mkdir(parents=True, exist_ok=True)
    plan = folder / "plan.json"
    plan.write_text(json.dumps([{"overrides": [], "env": {}, **r, "recipe": str(r["recipe"])} for r in runs]))
    res = subprocess.run(torchrun_cmd(nproc, str(REPO / "tests" / "rank_runs.py"), str(plan)), capture_output=True,
                         text=True, env={**os.environ, "OMP_NUM_THREADS": "1"}, timeout=timeout, cwd=REPO)
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-4000:]
    (folder / "output.txt").write_text(res.stdout)  # the runs' log lines, one after another
    return json.loads((folder / "statuses_rank0.json").read_text())


def torchrun_cmd(nproc: int, *program: str) -> list[str]:
    """torchrun on this machine (static rendezvous on a free port) running ``program`` (a script and its
    arguments, or ``-m module ...``): the one place the tests build a torchrun command line."""
    from convit_scale.train.distributed import free_port

    return [PY, "-m", "torch.distributed.run", f"--nproc-per-node={nproc}", "--nnodes=1", "--master-addr=127.0.0.1",
            f"--master-port={free_port()}", *program]


def ranks_cmd(recipe: Path, *overrides: str, nproc: int = 2) -> list[str]:
    return torchrun_cmd(nproc, "-m", "convit_scale.train", "--recipe", str(recipe), *overrides)


def records(out: Path, kind: str = "train") -> list[dict]:
    return read_records(out, kind)


def losses(out: Path) -> list[float]:
    return [r["loss"] for r in records(out)]


@pytest.fixture(scope="module")
def slurm(tmp_path_factory):
    """A local Slurm cluster (tests/slurm_cluster.py) for the module's jobs, 2 CPUs per node (the machine's 2 cores),
    so that a job can hold more than one CPU per rank."""
    from tests.slurm_cluster import LocalSlurm, missing_requirements  # tests.*: as `python -m tests.rehearsal` finds it

    why = missing_requirements()
    if why:
        pytest.fail(f"cannot start the local Slurm cluster: {why}")
    cluster = LocalSlurm(tmp_path_factory.mktemp("slurm"), cpus=2).start()
    yield cluster
    cluster.stop()
