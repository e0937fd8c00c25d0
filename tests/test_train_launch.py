"""Starting a recipe on N local processes (convit_scale/train/launch.py): the resolved config written for the ranks
to load is the config itself, and what would fail is refused in the launching process before any process starts
or any file is written. Runs on 1 and on 2 ranks are the engine's tests (test_train_engine.py)."""

from __future__ import annotations

import pytest
from support import tiny_recipe

from convit_scale.config import load_config
from convit_scale.data import DataError
from convit_scale.errors import BadInput
from convit_scale.train.launch import run_recipe, write_resolved


def test_the_resolved_config_the_ranks_load_is_the_config(fm_wds, tmp_path):
    recipe = tiny_recipe(tmp_path / "r.yaml", "wds", fm_wds, tmp_path / "out", schedule={"epochs": 3})
    cfg = load_config(recipe, ["optim.base_lr=3e-4", "data.global_batch_size=64"])
    path = write_resolved(cfg)
    assert path == tmp_path / "out" / "config.yaml"
    loaded = load_config(path)
    assert loaded.to_dict() == cfg.to_dict() and loaded.optim.base_lr == 3e-4 and loaded.schedule.epochs == 3


def test_what_would_fail_is_refused_before_any_process_or_file(fm_wds, tmp_path):
    recipe = tiny_recipe(tmp_path / "r.yaml", "wds", fm_wds, tmp_path / "out", parallel={"strategy": "none"})
    cfg = load_config(recipe)
    with pytest.raises(BadInput, match="nproc = 0: the number of local processes must be at least 1"):
        run_recipe(cfg, nproc=0)
    with pytest.raises(BadInput, match="parallel.strategy = 'none' on 2 ranks would train independent replicas"):
        run_recipe(cfg, nproc=2)  # the check that needs the world size, after the preflight
    with pytest.raises(DataError, match="fewer than data.global_batch_size = 4096"):  # the preflight's
        run_recipe(load_config(recipe, ["data.global_batch_size=4096"]), nproc=1, in_process=True)
    assert not (tmp_path / "out").exists()



def test_torchrun_started_from_another_thread_runs_in_this_process_group():
    """Runs trained side by side (``experiment sample-efficiency --jobs 2 --nproc 2``) start torchrun from pool
    threads, where no signal handler can be set: torchrun then stays in this process group (a signal to the group
    reaches it) and its status comes back."""
    import threading

    from convit_scale.train.launch import launch_torchrun

    seen = {}

    def start():
        seen["rc"] = launch_torchrun(["--help"], 2, quiet=True)

    t = threading.Thread(target=start)
    t.start()
    t.join(timeout=300)
    assert seen.get("rc") == 0 and not t.is_alive()
