"""Shared fixtures: the embedded Fashion-MNIST at test size, converted once per session by data_prep."""

from __future__ import annotations

from pathlib import Path

import pytest

# `make test` runs the files on 2 pytest-xdist workers, a file per worker at a time (--dist loadfile: a file's
# module fixtures are built once). The longest files go first so that none starts last and runs alone.
LONGEST_FIRST = ["test_slurm.py", "test_train_engine.py", "test_train_distill.py", "test_train_elastic.py",
                 "test_train_engine_faults.py", "test_slurm_site.py", "test_data_other_tools.py",
                 "test_train_unequal.py", "test_slurm_host_python.py", "test_experiments_demo.py",
                 "test_experiments_sample_efficiency.py", "test_planner.py", "test_bench_mfu.py",
                 "test_planner_comm.py", "test_data_shares.py", "test_data.py", "test_data_augment_on.py",
                 "test_launchers.py", "test_data_ffcv.py", "test_data_ffcv_epoch.py", "test_data_faults.py"]


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


@pytest.fixture(scope="module")
def slurm(tmp_path_factory):
    """A local Slurm cluster (convit_scale/rehearsal/cluster.py) for the module's jobs, 2 CPUs per node (the machine's
    2 cores), so that a job can hold more than one CPU per rank."""
    from convit_scale.rehearsal.cluster import LocalSlurm, missing_requirements

    why = missing_requirements()
    if why:
        pytest.fail(f"cannot start the local Slurm cluster: {why}")
    cluster = LocalSlurm(tmp_path_factory.mktemp("slurm"), cpus=2).start()
    yield cluster
    cluster.stop()
