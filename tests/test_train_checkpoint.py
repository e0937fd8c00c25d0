"""convit_scale/train/checkpoint.py: atomic publication, the resume point, checkpoints of another configuration."""

import json

import pytest
from support import tiny_recipe, train_here

from convit_scale.train.checkpoint import CheckpointIncompatible, check_compatible, choose_checkpoint


def test_a_crash_between_the_two_renames_of_a_same_step_save_loses_nothing(tmp_path):
    """step_N was moved to step_N.old and the crash came before step_N.tmp became step_N: resume finds it."""
    root = tmp_path / "checkpoints"
    for name, meta in (("step_000000002", True), ("step_000000004.old", True), ("step_000000004.tmp", False),
                       ("step_000000006.tmp", False)):
        (root / name).mkdir(parents=True)
        if meta:
            (root / name / "meta.json").write_text(json.dumps({"step": int(name[5:14])}))
    assert choose_checkpoint(root, "auto")[0] == root / "step_000000004"  # the old one put back, half-written gone
    assert sorted(p.name for p in root.iterdir()) == ["step_000000002", "step_000000004"]
    (root / "step_000000004").rename(root / "step_000000004.old")
    (root / "step_000000004.tmp").mkdir()
    (root / "step_000000004.tmp" / "meta.json").write_text("{}")  # the new one was complete: it is published
    assert choose_checkpoint(root, "auto")[0] == root / "step_000000004"
    assert not (root / "step_000000004.old").exists() and (root / "step_000000004" / "meta.json").read_text() == "{}"


def test_zero_offload_state_is_not_resumed_on_another_world_size(tmp_path):
    """ZeRO state resumes on any world size through DeepSpeed's universal checkpoint (tests/test_train_elastic.py),
    but ZeRO-Offload's, whose conversion is not supported here."""
    from convit_scale.config import load_config

    zero3 = load_config(None, ["parallel.strategy=zero3"]).to_dict()
    check_compatible(tmp_path, {"world_size": 4, "config": zero3}, zero3, world_size=2)
    offload = load_config(None, ["parallel.strategy=zero3", "parallel.zero_offload=true"]).to_dict()
    meta = {"world_size": 4, "config": offload}
    check_compatible(tmp_path, meta, offload, world_size=4)
    with pytest.raises(CheckpointIncompatible, match="ZeRO-Offload state .* of 4 ranks, the run has 2"):
        check_compatible(tmp_path, meta, offload, world_size=2)
    fsdp2 = load_config(None, ["parallel.strategy=fsdp2"]).to_dict()
    check_compatible(tmp_path, {"world_size": 4, "config": fsdp2}, fsdp2, world_size=2)
    # a checkpoint of an older release records strategy, model and global batch only: those are compared
    with pytest.raises(CheckpointIncompatible, match="parallel.strategy = 'zero3' -> 'fsdp2'"):
        check_compatible(tmp_path, {"strategy": "zero3", "model": "convit_small", "global_batch_size": 1024}, fsdp2)


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
        # the run folder still describes its checkpoints
        assert (tmp_path / "out" / "config.yaml").read_text() == config


# -- which checkpoint a start resumes from ------------------------------------------------------------------------
def _fake_checkpoint(root, step, config):
    path = root / "checkpoints" / f"step_{step:09d}"
    path.mkdir(parents=True)
    (path / "meta.json").write_text(json.dumps({"step": step, "world_size": 1, "config": config}))
    return path


def test_an_ablation_pointed_at_another_runs_folder_is_refused_naming_the_fields(tmp_path, capsys, fm_ffcv):
    """A Table 3 recipe submitted into the folder of Table 1's ConViT-S+: the checkpoint there belongs to another
    run, whatever the launcher, and the refusal names what differs."""
    from convit_scale.cli import main
    from convit_scale.config import load_config

    table1 = load_config("recipes/table1/convit_small_plus.yaml", [f"run.output_dir={tmp_path / 'run'}"])
    _fake_checkpoint(tmp_path / "run", 1000, table1.to_dict())
    ablation = load_config("recipes/table3/convit_small_plus_b_full.yaml", [f"run.output_dir={tmp_path / 'run'}"])
    with pytest.raises(CheckpointIncompatible, match=r"model.train_gating = True -> False"):
        check_compatible(tmp_path / "run", {"config": table1.to_dict()}, ablation.to_dict())
    # what only says where things are, how they are logged and laid out may change
    moved = load_config("recipes/table1/convit_small_plus.yaml", ["data.train_path=/elsewhere", "log.every_steps=7",
                                                                   "schedule.max_steps=5", "data.num_workers=3"])
    check_compatible(tmp_path / "run", {"config": table1.to_dict()}, moved.to_dict())
    before = sorted(p.name for p in (tmp_path / "run").rglob("*"))
    assert main(["train", "--recipe", "recipes/table3/convit_small_plus_b_full.yaml",
                 f"run.output_dir={tmp_path / 'run'}", f"data.train_path={fm_ffcv}", f"data.val_path={fm_ffcv}"]) == 2
    err = capsys.readouterr().err
    assert "belongs to another run" in err and "model.train_gating = True -> False" in err, err
    assert sorted(p.name for p in (tmp_path / "run").rglob("*")) == before  # refused before anything was written


def test_the_resume_source_is_for_the_first_start_only(tmp_path, monkeypatch):
    from convit_scale.train.checkpoint import resume_source

    root = tmp_path / "run" / "checkpoints"
    other = _fake_checkpoint(tmp_path / "other", 50, {})
    assert resume_source(root, str(other)) == (other, f"checkpoint.resume = {other}")  # the first start
    own = _fake_checkpoint(tmp_path / "run", 60, {})
    path, why = resume_source(root, str(other))  # a requeue with the same OVERRIDES: the run's own newest
    assert path == own and "was its starting point" in why
    _fake_checkpoint(tmp_path / "run", 80, {})
    with pytest.raises(CheckpointIncompatible, match="older than the run's newest checkpoint step_000000080"):
        resume_source(root, str(own))
    # none: a fresh start into a folder with checkpoints is refused, nothing is pruned; a restart continues them
    with pytest.raises(CheckpointIncompatible, match="checkpoint.resume=none would start another run into them"):
        resume_source(root, "none")
    monkeypatch.setenv("SLURM_RESTART_COUNT", "2")
    assert resume_source(root, "none")[0] == root / "step_000000080"
    assert sorted(p.name for p in root.iterdir()) == ["step_000000060", "step_000000080"]


@pytest.mark.slow
def test_a_requeue_with_an_explicit_resume_continues_its_own_run(fm_tree, tmp_path, capsys):
    """checkpoint.resume=PATH (OVERRIDES of a Slurm script) starts from PATH once; every later start of the job
    continues from the run's own newest checkpoint. The run keeps `latest` and `best/` beside its steps."""
    from convit_scale.trained import load_trained_model

    first = tiny_recipe(tmp_path / "a.yaml", "imagefolder", fm_tree, tmp_path / "a", schedule={"max_steps": 2},
                        log={"analysis_images": 0})
    assert train_here(first) == 0
    start = tmp_path / "a" / "checkpoints" / "step_000000002"
    job = tiny_recipe(tmp_path / "b.yaml", "imagefolder", fm_tree, tmp_path / "b", log={"analysis_images": 0},
                      checkpoint={"resume": str(start)}, schedule={"max_steps": 3})
    assert train_here(job) == 0
    assert "resumed step 2 from 1 rank(s) on 1" in capsys.readouterr().out
    assert train_here(job, "schedule.max_steps=4") == 0  # the same command again, as a requeue runs it
    out = capsys.readouterr().out
    assert "resumed step 3" in out and "was its starting point" in out
    root = tmp_path / "b" / "checkpoints"
    assert (root / "latest").read_text().strip() == "step_000000004"
    best = json.loads((root / "best" / "meta.json").read_text())
    assert best["eval"]["best_epoch"] == best["epoch"] - (best["batch_in_epoch"] == 0)
    assert load_trained_model(root / "best").head.weight.shape == (10, 32)
