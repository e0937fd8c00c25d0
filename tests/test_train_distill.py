"""The Table 4 teacher pinned by content (its SHA-256, whatever the file is called) and by an accuracy band."""

import hashlib
import json
import types

import pytest
import torch

from convit_scale.config import load_config
from convit_scale.train import distill

TEACHER = "regnety_002"


@pytest.fixture(scope="module")
def teacher(tmp_path_factory):
    """A RegNetY with random weights, in a file named as DeiT names its teacher: the name alone proves nothing."""
    import timm
    from safetensors.torch import save_file

    torch.manual_seed(1)
    path = tmp_path_factory.mktemp("teacher") / "regnety_160-a5fe301d.safetensors"
    save_file({k: v.contiguous() for k, v in timm.create_model(TEACHER, num_classes=10).state_dict().items()},
              str(path))
    return path


def _recipe(tmp_path, data, teacher, **distill_keys):
    from support import tiny_recipe

    return tiny_recipe(tmp_path / "r.yaml", "wds", data, tmp_path / "run",
                       distill={"enabled": True, "teacher_model": TEACHER, "teacher_checkpoint": str(teacher),
                                **distill_keys})


def test_a_renamed_teacher_whose_content_is_not_the_pinned_one_is_refused(fm_wds, teacher, tmp_path, capsys):
    """Named regnety_160-a5fe301d, or anything else: the recipe's pin is checked against the file's SHA-256."""
    from convit_scale.cli import main

    sha = hashlib.sha256(teacher.read_bytes()).hexdigest()
    renamed = teacher.parent / "teacher.safetensors"
    renamed.write_bytes(teacher.read_bytes())
    for path in (teacher, renamed):
        r = _recipe(tmp_path, fm_wds, path, teacher_sha256="a5fe301d")
        assert main(["train", "--recipe", str(r)]) == 2
        (line,) = [x for x in capsys.readouterr().err.splitlines() if x.startswith("error:")]
        assert str(path) in line and sha in line and "does not start with a5fe301d" in line, line
        assert "distill.teacher_sha256" in line and "regnety_160-a5fe301d.pth" in line
        assert not (tmp_path / "run").exists()  # refused before anything was written


def test_the_pinned_file_loads_whatever_its_name_and_ranks_reuse_its_hash(fm_wds, teacher, tmp_path, monkeypatch):
    sha = hashlib.sha256(teacher.read_bytes()).hexdigest()
    renamed = teacher.parent / "any_name.safetensors"
    renamed.write_bytes(teacher.read_bytes())
    cfg = load_config(_recipe(tmp_path, fm_wds, renamed, teacher_sha256=sha[:12]))
    distill.build_teacher(cfg)  # preflight: hashes the file, then keeps the hash in the run's folder
    cached = json.loads((tmp_path / "run" / distill.HASH_CACHE).read_text())
    assert cached["sha256"] == sha and cached["path"] == str(renamed.resolve())

    def no_rehash(*args):
        raise AssertionError("the teacher was hashed again")

    monkeypatch.setattr(distill, "_sha256", no_rehash)
    distill.build_teacher(cfg)  # another rank, or the job after a requeue: the run's folder has the hash
    renamed.write_bytes(teacher.read_bytes())  # the file changed (its modification time): hashed again
    with pytest.raises(AssertionError, match="hashed again"):
        distill.build_teacher(cfg)


def test_the_accuracy_band_refuses_a_teacher_above_it(fm_wds, teacher, tmp_path, capsys):
    from convit_scale.config import DataConfig
    from convit_scale.data import LoaderSpec, build_loader

    plain = tmp_path / "plain.safetensors"
    plain.write_bytes(teacher.read_bytes())
    cfg = load_config(_recipe(tmp_path, fm_wds, plain, teacher_min_top1=0.0, teacher_max_top1=0.0))
    model = distill.build_teacher(cfg)
    loader = build_loader(DataConfig(format="wds", val_path=str(fm_wds), num_workers=0), LoaderSpec("val", 16, 50))
    ctx = types.SimpleNamespace(world_size=1, device=torch.device("cpu"), is_main=True)
    top1 = distill.evaluate(model, loader, ctx.device)["top1"]
    assert top1 > 0  # a random 10-class teacher gets some right
    with pytest.raises(ValueError, match=r"above distill.teacher_max_top1 = 0: wrong file"):
        distill.check_teacher(model, cfg, loader, ctx)
    cfg.distill.teacher_max_top1 = 100.0
    distill.check_teacher(model, cfg, loader, ctx)  # inside the band
    assert "teacher_max_top1 = 100" in capsys.readouterr().out
