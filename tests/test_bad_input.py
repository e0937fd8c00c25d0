"""Bad input, tried as a new user would: each case is refused with exit status 2 and exactly one `error:` line
naming the input and what is allowed, without a traceback, before anything is written where it should not be.

Every case runs through ``convit_scale.cli.main`` in this process on real files: recipes, prep outputs written
by data_prep (WebDataset and FFCV), weights files, checkpoint folders. One case per command family that starts
processes runs as a real subprocess.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from support import REPO, run_cli, tiny_recipe

from convit_scale.cli import main


def snapshot(*roots: Path) -> dict:
    """Every path under ``roots`` with its size and mtime: what "nothing written" compares."""
    found = {}
    for root in roots:
        for p in [root, *root.rglob("*")] if root.exists() else []:
            st = p.stat()
            found[str(p)] = (p.is_dir(), st.st_size if p.is_file() else 0, st.st_mtime_ns)
    return found


def refused(argv: list[str], capsys, *words: str) -> str:
    """Run the command; assert status 2 and one `error:` line holding every word; return the line."""
    assert main([str(a) for a in argv]) == 2
    out, err = capsys.readouterr()
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), err
    assert "Traceback" not in err and "weights_only" not in err, err
    for word in words:
        assert word in lines[0], f"{word!r} not in {lines[0]!r}"
    return lines[0]


# -- recipes ---------------------------------------------------------------------------------------------------
DEMO = "recipes/cpu/demo.yaml"


@pytest.mark.parametrize("override,key", [
    ("optim.base_lr=5e400", "optim.base_lr = inf"),
    ("optim.eps=.nan", "optim.eps = nan"),
    ("optim.betas=[0.9,.inf]", "optim.betas[1] = inf"),
    ("model.locality_strength=-.inf", "model.locality_strength = -inf"),
    ("paper.top1=.nan", "paper.top1 = nan"),
])
def test_non_finite_floats_are_refused(override, key, capsys, monkeypatch):
    monkeypatch.chdir(REPO)
    refused(["config", DEMO, override], capsys, key, "must be a finite number")


@pytest.mark.parametrize("text,key,line,first", [
    ("model:\n  name: convit_nano\noptim:\n  base_lr: 1.0e-3\nmodel:\n  num_classes: 10\n", "'model'", 5, 1),
    ("model:\n  name: convit_nano\n  num_classes: 10\n  name: convit_micro\n", "'name'", 4, 2),
])
def test_a_key_given_twice_in_a_recipe_is_refused(text, key, line, first, tmp_path, capsys):
    recipe = tmp_path / "r.yaml"
    recipe.write_text(text)
    refused(["config", recipe], capsys, f"{recipe}:{line}", key, "twice", f"first on line {first}",
            "each key may appear once")
    base = tmp_path / "child.yaml"  # found in a base recipe too, named by the base's file
    base.write_text(f"base: {recipe.name}\n")
    refused(["config", base], capsys, f"{recipe}:{line}", key)


# -- prep ------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("flag,value,allowed", [
    ("--subset-fraction", "1.5", "(0, 1]"), ("--subset-fraction", "0", "(0, 1]"),
    ("--jpeg-quality", "150", "1..100"), ("--jpeg-quality", "0", "1..100"),
])
def test_prep_numbers_out_of_range(flag, value, allowed, tmp_path, capsys):
    refused(["prep", "ffcv", "--src", tmp_path / "src", "--out", tmp_path / "out", flag, value], capsys,
            flag, value, allowed)
    assert not list(tmp_path.iterdir())


def test_prep_out_inside_src_is_refused(fm_tree, capsys):
    before = snapshot(fm_tree)
    for out in (fm_tree / "shards", fm_tree, fm_tree / "train" / "x"):
        refused(["prep", "wds", "--src", fm_tree, "--out", out], capsys, str(out), "inside --src",
                "allowed: a folder outside --src")
    assert snapshot(fm_tree) == before


def test_prep_refuses_a_folder_of_other_files_or_another_format(fm_tree, fm_wds, tmp_path, capsys, request):
    user = tmp_path / "mine"
    user.mkdir()
    (user / "notes.txt").write_text("the user's own file")
    before = snapshot(user, fm_wds)
    refused(["prep", "wds", "--src", fm_tree, "--out", user], capsys, str(user), "not empty", "no manifest.json",
            "allowed: a new or empty folder")
    refused(["prep", "ffcv", "--src", fm_tree, "--out", fm_wds], capsys, str(fm_wds), "holds a `prep wds` output",
            "allowed: a new or empty folder, or an earlier `prep ffcv` output")
    refused(["prep", "wds", "--src", fm_tree, "--out", user / "notes.txt"], capsys, "notes.txt", "is a file")
    assert snapshot(user, fm_wds) == before
    fm_ffcv = request.getfixturevalue("fm_ffcv")
    capsys.readouterr()  # the conversion's progress output, when this test made the session's FFCV data
    before = snapshot(fm_ffcv)
    refused(["prep", "wds", "--src", fm_tree, "--out", fm_ffcv], capsys, "holds a `prep ffcv` output")
    assert snapshot(fm_ffcv) == before


def test_prep_subset_that_keeps_no_image(fm_tree, tmp_path, capsys):
    refused(["prep", "wds", "--src", fm_tree, "--out", tmp_path / "o", "--subset-fraction", "0.001"], capsys,
            "--subset-fraction 0.001 keeps no image", "allowed: f >= 0.01")
    assert not (tmp_path / "o").exists()


# -- export, eval, analyze ---------------------------------------------------------------------------------------
def _not_a_checkpoint(tmp_path: Path) -> dict[str, Path]:
    files = {"random": tmp_path / "random.pth", "text": tmp_path / "notes.txt",
             "fake_safetensors": tmp_path / "fake.safetensors", "pickle": tmp_path / "args.pth"}
    files["random"].write_bytes(bytes(range(256)) * 8)
    files["text"].write_text("not a checkpoint\n")
    files["fake_safetensors"].write_text("not a safetensors file either\n")
    import argparse

    torch.save({"model": {}, "args": argparse.Namespace(lr=1)}, files["pickle"])
    return files


def test_export_refuses_a_wrong_suffix_and_an_existing_folder(tmp_path, capsys):
    ckpt = tmp_path / "ckpt"  # refused for --out before its state is read
    ckpt.mkdir()
    (ckpt / "meta.json").write_text(json.dumps({"step": 1, "config": {"model": {"name": "convit_nano"}}}))
    refused(["export", "--checkpoint", ckpt, "--out", tmp_path / "m.pth"], capsys, "m.pth",
            "allowed: a file name ending in .safetensors")
    folder = tmp_path / "m.safetensors"
    folder.mkdir()
    refused(["export", "--checkpoint", ckpt, "--out", folder], capsys, str(folder), "existing folder")
    refused(["export", "--checkpoint", tmp_path / "nockpt", "--out", tmp_path / "new" / "deep" / "m.safetensors"],
            capsys, str(tmp_path / "nockpt"), "does not exist", "allowed: a run folder")
    refused(["export", "--checkpoint", ckpt, "--out", tmp_path / "new" / "deep" / "m.safetensors"], capsys,
            str(ckpt), "neither a DCP nor a DeepSpeed checkpoint")
    assert sorted(p.name for p in tmp_path.rglob("*")) == ["ckpt", "m.safetensors", "meta.json"]  # no .tmp or folder


def test_eval_and_analyze_name_a_file_that_is_no_checkpoint(tmp_path, capsys):
    files = _not_a_checkpoint(tmp_path)
    data, out = tmp_path / "data", tmp_path / "analysis"  # the format named: the data is not looked at first
    for cmd in (["eval", "--format", "wds"], ["analyze", "--format", "wds", "--out", out]):
        refused([*cmd, "--checkpoint", tmp_path / "missing.pth", "--data", data], capsys,
                f"checkpoint not found: {tmp_path / 'missing.pth'}", "allowed: a run checkpoint folder")
        refused([*cmd, "--checkpoint", tmp_path, "--data", data], capsys, str(tmp_path), "no meta.json")
        for name in ("random", "text", "pickle"):
            for model in ([], ["--model", "convit_nano"]):
                refused([*cmd, "--checkpoint", files[name], *model, "--data", data], capsys, str(files[name]),
                        "not a weights file", "allowed: a .safetensors file or a .pth/.pt/.bin state dict")
        refused([*cmd, "--checkpoint", files["fake_safetensors"], "--data", data], capsys,
                str(files["fake_safetensors"]), "not a readable safetensors file")
    line = refused(["eval", "--format", "wds", "--checkpoint", files["pickle"], "--data", data], capsys)
    assert "argparse.Namespace" in line  # what the file pickles, not torch's advice to unpickle it
    assert not out.exists() and not data.exists()


# -- train: refused in the launching process, before any rank starts ---------------------------------------------
def _recipe(tmp_path: Path, fmt: str, data: Path, **sections) -> Path:
    return tiny_recipe(tmp_path / "r.yaml", fmt, data, tmp_path / "out", parallel={"strategy": "none"}, **sections)


def _ffcv_copy(fm_ffcv: Path, tmp_path: Path) -> Path:
    copy = tmp_path / "ffcv"
    shutil.copytree(fm_ffcv, copy)
    return copy


def _truncated_beton(fm_ffcv: Path, tmp_path: Path) -> Path:
    copy = _ffcv_copy(fm_ffcv, tmp_path)
    beton = next(copy.glob("train_*.beton"))
    beton.write_bytes(beton.read_bytes()[: beton.stat().st_size // 3])
    return copy


def _missing_beton(fm_ffcv: Path, tmp_path: Path) -> Path:
    copy = _ffcv_copy(fm_ffcv, tmp_path)
    next(copy.glob("val_*.beton")).unlink()
    return copy


def _subset_beton(fm_ffcv: Path, tmp_path: Path) -> Path:
    """A .beton converted with a Table 2 subset already (as its manifest records it)."""
    copy = _ffcv_copy(fm_ffcv, tmp_path)
    manifest = json.loads((copy / "manifest.json").read_text())
    manifest["options"]["subset_fraction"] = 0.5
    (copy / "manifest.json").write_text(json.dumps(manifest))
    return copy


TRAIN_CASES = [  # (id, data fixture or maker, format, overrides, words in the error line)
    ("dataset smaller than the global batch", "fm_wds", "wds", ["data.global_batch_size=2048"],
     ["holds 1000 training images", "data.global_batch_size = 2048", "allowed: data.global_batch_size <= 1000"]),
    ("ffcv subset smaller than the global batch", "fm_ffcv", "ffcv", ["data.subset_fraction=0.01"],
     ["holds 10 training images (subset_fraction 0.01)", "data.global_batch_size = 32"]),
    ("num_classes below the data's", "fm_wds", "wds", ["model.num_classes=5"],
     ["model.num_classes = 5", "10 classes", "allowed: >= 10"]),
    ("wds folder given as ffcv", "fm_wds", "ffcv", [], ["holds wds data", "data.format = 'ffcv'",
                                                         "allowed: data.format = 'wds'"]),
    ("ffcv folder given as wds", "fm_ffcv", "wds", [], ["holds ffcv data", "allowed: data.format = 'ffcv'"]),
    ("prepared folder given as imagefolder", "fm_wds", "imagefolder", [], ["no train folder", "data.format"]),
    ("ffcv subset of a subset", _subset_beton, "ffcv", ["data.subset_fraction=0.5"],
     ["holds a subset already (prep --subset-fraction 0.5)", "would keep 0.25 of each class", "allowed"]),
    ("truncated .beton", _truncated_beton, "ffcv", [], ["data.train_path", ".beton has", "truncated",
                                                         "prep verify"]),
    ("missing .beton", _missing_beton, "ffcv", [], ["data.val_path", ".beton is missing", "manifest.json"]),
    ("pipe: location that fails", "fm_wds", "wds", ["data.train_path='pipe:exit 3 {name}'"],
     ["data.train_path", "pipe:exit 3 manifest.json failed", "allowed"]),
    ("http location that refuses", "fm_wds", "wds", ["data.train_path=http://127.0.0.1:9/{name}"],
     ["data.train_path", "http://127.0.0.1:9/manifest.json is not readable", "allowed"]),
    ("non-finite learning rate", "fm_wds", "wds", ["optim.base_lr=5e400"], ["optim.base_lr = inf", "finite"]),
]


@pytest.mark.parametrize("case", TRAIN_CASES, ids=[c[0] for c in TRAIN_CASES])
def test_train_refuses_before_any_rank_starts(case, tmp_path, capsys, request):
    _, data, fmt, overrides, words = case
    data = request.getfixturevalue(data) if isinstance(data, str) else data(request.getfixturevalue("fm_ffcv"),
                                                                             tmp_path)
    capsys.readouterr()  # the conversion's progress output, when this test made the session's data
    recipe = _recipe(tmp_path, fmt, data)
    before = snapshot(data)
    refused(["train", "--recipe", recipe, *overrides], capsys, *words)
    assert not (tmp_path / "out").exists() and snapshot(data) == before


def test_train_probes_a_silent_remote_location_once(fm_wds, tmp_path, capsys, monkeypatch):
    from convit_scale.train import preflight

    monkeypatch.setattr(preflight, "PROBE_TIMEOUT_S", 1)  # the probe's limit (10 s), shortened for the test
    recipe = _recipe(tmp_path, "wds", fm_wds)
    refused(["train", "--recipe", recipe, "data.train_path='pipe:sleep 30; cat {name}'"], capsys,
            "data.train_path", "pipe:sleep 30; cat manifest.json gave no answer within 1 s")
    assert not (tmp_path / "out").exists()


def test_train_refuses_pretrained_weights_of_another_model(fm_wds, tmp_path, capsys):
    from convit_scale.models import create_model

    weights = tmp_path / "micro.pth"
    torch.save(create_model("convit_micro").state_dict(), weights)
    recipe = _recipe(tmp_path, "wds", fm_wds, model={"pretrained": str(weights)})
    refused(["train", "--recipe", recipe], capsys, f"model.pretrained {weights} (convit_nano) does not match",
            "missing keys", "unexpected keys")
    assert not (tmp_path / "out").exists()


def test_train_refuses_an_output_folder_it_cannot_make(fm_wds, tmp_path, capsys):
    (tmp_path / "afile").write_text("x")
    recipe = _recipe(tmp_path, "wds", fm_wds)
    refused(["train", "--recipe", recipe, f"run.output_dir={tmp_path / 'afile' / 'run'}"], capsys,
            "run.output_dir", "afile is a file", "allowed: a folder that can be created and written")
    assert (tmp_path / "afile").read_text() == "x" and not (tmp_path / "out").exists()


@pytest.mark.parametrize("saved,override,key", [
    ({"model": "convit_micro"}, [], "model.name = 'convit_micro'"),
    ({"strategy": "ddp"}, [], "parallel.strategy = 'ddp'"),
    ({"global_batch_size": 64}, [], "data.global_batch_size = 64"),
])
def test_resume_of_another_run_is_refused_and_config_yaml_kept(saved, override, key, fm_wds, tmp_path, capsys):
    """A checkpoint's meta.json records the model, strategy and global batch it was written with (the fields
    train/checkpoint.check_compatible reads): resuming under another recipe is refused before config.yaml is
    rewritten."""
    recipe = _recipe(tmp_path, "wds", fm_wds)
    ckpt = tmp_path / "out" / "checkpoints" / "step_000000001"
    ckpt.mkdir(parents=True)
    meta = {"step": 1, "model": "convit_nano", "strategy": "none", "global_batch_size": 32, **saved}
    (ckpt / "meta.json").write_text(json.dumps(meta))
    (tmp_path / "out" / "config.yaml").write_text("the first run's config\n")
    before = snapshot(tmp_path / "out")
    for resume in (["--resume", "auto"], ["--resume", str(ckpt)]):
        refused(["train", "--recipe", recipe, *resume, *override], capsys, str(ckpt), key,
                "resume with the same")
    assert snapshot(tmp_path / "out") == before


def test_train_refusal_in_a_real_process(fm_ffcv, tmp_path):
    """The command as a user runs it: exit status 2, one line, no traceback, no process group, nothing written."""
    recipe = _recipe(tmp_path, "wds", fm_ffcv)
    res = run_cli("train", "--recipe", str(recipe), "--nproc-per-node", "2")
    lines = res.stderr.strip().splitlines()
    assert res.returncode == 2 and len(lines) == 1 and lines[0].startswith("error: "), res.stderr[-3000:]
    assert "holds ffcv data" in lines[0] and "Traceback" not in res.stderr
    assert not (tmp_path / "out").exists()


# -- a bug is not bad input --------------------------------------------------------------------------------------
def _bug(*args, **kwargs):
    raise ValueError("max() arg is an empty sequence")  # what a bug of the code raises, not a refusal of input


def test_a_value_error_of_the_code_is_a_crash_not_bad_input(fm_wds, tmp_path, capsys, monkeypatch):
    """Before: any ValueError was taken for bad input (one `error:` line, exit 2): a bug hid as the user's mistake
    and a Slurm job ended as refused, without a traceback or a restart. Bad input still refuses in one line."""
    from support import train_here

    from convit_scale.train import __main__ as rank_main
    from convit_scale.train import setup

    recipe = _recipe(tmp_path, "wds", fm_wds)
    refused(["train", "--recipe", recipe, "data.global_batch_size=2048"], capsys, "data.global_batch_size = 2048")
    assert rank_main.main(["--recipe", str(recipe), "data.global_batch_size=2048"]) == 2
    assert "error: " in capsys.readouterr().err
    monkeypatch.setattr(setup, "build_model", _bug)  # a bug in set-up, on a rank
    with pytest.raises(ValueError, match="empty sequence"):
        train_here(recipe)
    monkeypatch.setattr(rank_main, "preflight", _bug)  # a bug in the checks before the process group forms
    with pytest.raises(ValueError, match="empty sequence"):
        rank_main.main(["--recipe", str(recipe)])
    monkeypatch.setattr("convit_scale.config.load_config", _bug)
    with pytest.raises(ValueError, match="empty sequence"):
        main(["config", str(recipe)])


def test_a_bug_in_a_ranks_set_up_ends_it_as_a_crash_with_its_traceback(fm_wds, tmp_path):
    """The rank as srun starts it: a bug is exit status 1 and a traceback (slurm/launch.sh restarts a crash; status 2,
    bad input, it does not)."""
    import subprocess
    import sys

    recipe = _recipe(tmp_path, "wds", fm_wds)
    code = ("import sys; import convit_scale.train.setup as s\n"
            "def bug(*a, **k):\n    raise ValueError('max() arg is an empty sequence')\n"
            "s.build_model = bug\nfrom convit_scale.train.__main__ import main\n"
            f"sys.exit(main(['--recipe', {str(recipe)!r}]))")
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, cwd=REPO)
    assert res.returncode == 1, res.stderr[-3000:]
    assert "Traceback" in res.stderr and "ValueError: max() arg is an empty sequence" in res.stderr
    assert "error: max()" not in res.stderr
