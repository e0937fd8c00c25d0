"""Shared fixtures: the embedded Fashion-MNIST at test size, converted once per session by data_prep."""

from __future__ import annotations

import faulthandler
import os
from pathlib import Path

import pytest

# A test that hangs must fail, not hold the suite until CI's own limit ends it with nothing said. pytest-timeout
# (pyproject's --timeout) raises in a test that is past it, but only from a signal handler, which runs when the
# main thread is back in Python: a test stuck in C (a lock taken in a forked child, a wait inside a C++ library)
# never gets there, and neither does one whose teardown hangs after the timeout was raised. So each test, set-up
# and teardown included, also has a hard limit kept by faulthandler's own C thread, which needs neither the GIL nor
# the main thread: past it, every thread's stack goes to the terminal and the worker exits; pytest-xdist names the
# test its worker crashed in, starts another worker and goes on.
HARD_LIMIT_S = 780  # pytest-timeout's --timeout (pyproject), then time for that failure's own teardown
_terminal = {}


def pytest_configure(config):
    # Taken before any test's output is captured: the real stderr, which xdist's workers share with the terminal.
    _terminal["fd"] = os.dup(2)
    # The width of the terminal that started the suite is not the tests': a COLUMNS a shell or CI exports would fold
    # the commands' prose (plan) and tables; a test that wants a width sets it (tests/test_console.py).
    os.environ.pop("COLUMNS", None)
    os.environ.pop("LINES", None)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    faulthandler.dump_traceback_later(HARD_LIMIT_S, exit=True, file=_terminal["fd"])
    try:
        yield
    finally:
        faulthandler.cancel_dump_traceback_later()

# `make test` runs the files on 2 pytest-xdist workers, a file per worker at a time (--dist loadfile: a file's
# module fixtures are built once). The longest files go first so that none starts last and runs alone.
LONGEST_FIRST = ["test_users_commands.py", "test_slurm.py", "test_train_engine.py", "test_train_distill.py",
                 "test_train_elastic.py",
                 "test_train_engine_faults.py", "test_slurm_site.py", "test_data_other_tools.py",
                 "test_train_unequal.py", "test_slurm_host_python.py", "test_experiments_demo.py",
                 "test_experiments_sample_efficiency.py", "test_planner.py", "test_bench_mfu.py",
                 "test_planner_comm.py", "test_data_steps.py", "test_data.py", "test_data_augment_on.py",
                 "test_launchers.py", "test_data_ffcv.py", "test_data_ffcv_epoch.py", "test_data_faults.py"]


LAST = ["test_dryrun.py"]
"""Files a worker runs after every other of its files, where --dist loadfile gives its worker nothing after them. A
dry run changes process-wide state for its duration (torch.cuda's answers, DeepSpeed's accelerator, the autograd
engine's threads) and puts it back; the one it once left behind (DeepSpeed imported under the simulated GPUs kept
their accelerator) is fixed and tested in a fresh process (test_dryrun.py); last, what it may still leave reaches
no other file."""


def pytest_collection_modifyitems(items):
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
    rank.update({name: len(rank) + 1 + i for i, name in enumerate(LAST)})
    items.sort(key=lambda item: rank.get(item.path.name, len(LONGEST_FIRST)))  # stable: a file's order is kept


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
