"""convit_scale/train/checkpoint.py: atomic publication, the resume point, checkpoints of another configuration."""

import json

import pytest

from conftest import tiny_recipe, train_here
from convit_scale.train.checkpoint import CheckpointIncompatible, check_compatible, choose_checkpoint


def test_a_crash_between_the_two_renames_of_a_same_step_save_loses_nothing(tmp_path):
    """step_N was moved to step_N.old and the crash came before step_N.tmp became step_N: resume finds it."""
    root = tmp_path / "checkpoints"
    for name, meta in (("step_000000002", True), ("step_000000004.old", True), ("step_000000004.tmp", False),
                       ("step_000000006.tmp", False)):
        (root / name).mkdir(parents=True)
        if meta:
            (root / name / "meta.json").write_text(json.dumps({"step": int(name[5:14])}))
    assert choose_checkpoint(root, "auto") == root / "step_000000004"  # the old one put back, half-written ones gone
    assert sorted(p.name for p in root.iterdir()) == ["step_000000002", "step_000000004"]
    (root / "step_000000004").rename(root / "step_000000004.old")
    (root / "step_000000004.tmp").mkdir()
    (root / "step_000000004.tmp" / "meta.json").write_text("{}")  # the new one was complete: it is published
    assert choose_checkpoint(root, "auto") == root / "step_000000004"
    assert not (root / "step_000000004.old").exists() and (root / "step_000000004" / "meta.json").read_text() == "{}"


def test_zero_state_is_not_resumed_on_another_world_size(tmp_path):
    meta = {"strategy": "zero3", "model": "convit_tiny", "global_batch_size": 32, "world_size": 4}
    expected = {"strategy": "zero3", "model": "convit_tiny", "global_batch_size": 32}
    check_compatible(tmp_path, meta, {**expected, "world_size": 4})
    with pytest.raises(CheckpointIncompatible, match="partitioned over 4 ranks, the run has 2"):
        check_compatible(tmp_path, meta, {**expected, "world_size": 2})
    check_compatible(tmp_path, {**meta, "strategy": "fsdp2"}, {**expected, "strategy": "fsdp2", "world_size": 2})


def test_checkpoint_of_another_strategy_or_global_batch_is_refused(fm_tree, tmp_path, capsys):
    from convit_scale.cli import main

    r = tiny_recipe(tmp_path / "r.yaml", "imagefolder", fm_tree, tmp_path / "out", data={"val_path": ""},
                    parallel={"strategy": "zero3"}, schedule={"max_steps": 1})
    assert train_here(r) == 0
    config = (tmp_path / "out" / "config.yaml").read_text()
    capsys.readouterr()
    for override, names in (("parallel.strategy=fsdp2", ("parallel.strategy", "'zero3'", "'fsdp2'")),
                            ("data.global_batch_size=16", ("data.global_batch_size", "32", "16"))):
        assert main(["train", "--recipe", str(r), override, "schedule.max_steps=2"]) == 2
        errors = [line for line in capsys.readouterr().err.splitlines() if line.startswith("error:")]
        assert len(errors) == 1 and all(n in errors[0] for n in names), errors
        assert (tmp_path / "out" / "config.yaml").read_text() == config  # the run folder still describes its checkpoints
