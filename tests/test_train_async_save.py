"""Checkpoints written beside training (checkpoint.async_save): DCP's async_save under 2 gloo ranks."""

import json

import pytest
from support import records, run_many, tiny_recipe

pytestmark = pytest.mark.slow


def _run(fm_tree, tmp_path, name, async_save, max_steps, resume="auto"):
    out = tmp_path / name
    recipe = tiny_recipe(tmp_path / f"{name}.yaml", "imagefolder", fm_tree, out,
                         parallel={"strategy": "ddp", "precision": "fp32", "timeout_s": 60},
                         checkpoint={"every_steps": 2, "async_save": async_save, "keep_last": 5, "resume": resume},
                         schedule={"epochs": 2, "warmup_epochs": 1, "max_steps": max_steps})
    return {"recipe": recipe, "overrides": []}, out


def test_async_saves_publish_after_the_write_and_resume_bit_exactly(fm_tree, tmp_path):
    """The same run saving beside training and at once: the same checkpoints published, the same losses; a run
    resumed from an async save continues as the sync run did."""
    sync, sync_out = _run(fm_tree, tmp_path, "sync", False, 6)
    first, async_out = _run(fm_tree, tmp_path, "async", True, 4)
    second, _ = _run(fm_tree, tmp_path, "async", True, 6)
    assert run_many([sync, first, second], tmp_path / "ranks") == [0, 0, 0]
    names = sorted(p.name for p in (sync_out / "checkpoints").glob("step_*"))
    assert sorted(p.name for p in (async_out / "checkpoints").glob("step_*")) == names
    assert not list((async_out / "checkpoints").glob("*.tmp"))
    saves = records(async_out, "checkpoint")
    assert any(r["background"] for r in saves) and not any(r["background"] for r in records(sync_out, "checkpoint"))
    sync_losses = {r["step"]: r["loss"] for r in records(sync_out)}
    async_losses = {r["step"]: r["loss"] for r in records(async_out)}
    assert async_losses == sync_losses  # bit-exact: the resumed steps 5 and 6 as well
    meta = json.loads((async_out / "checkpoints" / names[-1] / "meta.json").read_text())
    assert meta["step"] == 6
