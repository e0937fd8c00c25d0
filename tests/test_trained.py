"""A finished run's model (convit_scale/trained.py): which checkpoint a user's name means (a run folder's newest
complete one, RUN:latest, RUN:best), and a DCP checkpoint consolidated without a process group, exported to
safetensors with its run's model config and evaluation view, and loaded back as the same model."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch
import torch.distributed.checkpoint as dcp

from convit_scale import trained
from convit_scale.config import load_config
from convit_scale.errors import BadInput
from convit_scale.models import create_model
from convit_scale.trained import consolidate, eval_view, export, load_trained_model, run_checkpoint


def _step(root, name: str, complete: bool = True):
    (root / name).mkdir(parents=True)
    if complete:
        (root / name / "meta.json").write_text("{}")
    return root / name


def test_a_runs_checkpoint_is_its_newest_complete_one_or_the_one_named(tmp_path):
    root = tmp_path / "run" / "checkpoints"
    old, new = _step(root, "step_000000002"), _step(root, "step_000000010")
    _step(root, "step_000000011", complete=False)  # being written: no meta.json yet
    _step(root, "step_latest")
    assert trained.complete_checkpoints(root) == [old, new] and trained.latest_checkpoint(root) == new
    assert run_checkpoint(tmp_path / "run") == new == run_checkpoint(f"{tmp_path / 'run'}:latest")
    assert run_checkpoint(old) == old and run_checkpoint(tmp_path / "w.safetensors") == tmp_path / "w.safetensors"
    with pytest.raises(FileNotFoundError, match="the run has no best checkpoint yet"):
        run_checkpoint(f"{tmp_path / 'run'}:best")
    best = _step(root, "best")
    assert run_checkpoint(f"{tmp_path / 'run'}:best") == best
    for path in (old, new):
        (path / "meta.json").unlink()
    with pytest.raises(FileNotFoundError, match="no complete checkpoint in"):
        run_checkpoint(tmp_path / "run")
    with pytest.raises(FileNotFoundError, match="is not a run folder"):
        run_checkpoint(f"{tmp_path}:latest")
    nothing = tmp_path / "nothing"
    assert trained.complete_checkpoints(nothing) == [] and trained.latest_checkpoint(nothing) is None


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")  # one process saves, as intended
def test_a_dcp_checkpoint_exports_and_loads_as_the_same_model(tmp_path):
    cfg = load_config(None, ["model.name=convit_nano", "model.num_classes=10", "data.eval_crop_ratio=0.9"])
    torch.manual_seed(0)
    model = create_model("convit_nano", num_classes=10).eval()
    checkpoint = tmp_path / "step_000000005"
    dcp.save({"model": model.state_dict()}, checkpoint_id=str(checkpoint / "dcp"))  # no process group
    with pytest.raises(FileNotFoundError, match="no meta.json"):
        consolidate(checkpoint)
    config = {"model": dataclasses.asdict(cfg.model), "data": dataclasses.asdict(cfg.data)}
    (checkpoint / "meta.json").write_text(json.dumps({"config": config, "step": 5}))
    state = consolidate(checkpoint)
    assert state.keys() == model.state_dict().keys()
    assert all(torch.equal(state[k], v.float()) for k, v in model.state_dict().items())

    with pytest.raises(BadInput, match="allowed: a file name ending in .safetensors"):
        export(checkpoint, tmp_path / "model.pt")
    out = export(checkpoint, tmp_path / "new" / "model.safetensors")
    assert eval_view(out) == eval_view(checkpoint) == {"eval_crop_ratio": 0.9, "interpolation": "bicubic",
                                                       "num_classes": None}
    x = torch.randn(2, 3, 16, 16)  # convit_nano: 16 pixels
    with torch.no_grad():
        want = model(x)
        for path in (out, checkpoint):  # no model name given: the run's own config says what to build
            assert torch.equal(load_trained_model(path)(x), want), path
