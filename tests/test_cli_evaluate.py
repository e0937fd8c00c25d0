"""`convit-scale eval` (convit_scale/cli/evaluate.py): the data's format read from the folder, the results file;
`analyze` reads the format the same way."""

from __future__ import annotations

import json

import pytest
import torch

from convit_scale.cli import main
from convit_scale.config import DataConfig
from convit_scale.data import LoaderSpec, build_loader
from convit_scale.models import create_model


@pytest.fixture(scope="module")
def weights(tmp_path_factory):
    torch.manual_seed(0)
    model = create_model("convit_nano", num_classes=10)
    path = tmp_path_factory.mktemp("weights") / "nano.pth"
    torch.save(model.state_dict(), path)
    return path, model.eval()


def _eval(capsys, weights, data, *extra) -> str:
    assert main(["eval", "--checkpoint", str(weights), "--model", "convit_nano", "--data", str(data),
                 "--workers", "1", "--device", "cpu", *extra]) == 0
    return capsys.readouterr().out


def test_eval_on_an_ffcv_folder_without_format(weights, fm_ffcv, tmp_path, capsys):
    """Before: --format defaulted to wds, and an FFCV folder ended in a worker traceback."""
    out = _eval(capsys, weights[0], fm_ffcv, "--results-file", str(tmp_path / "r.json"))
    assert "(200 images on cpu, ffcv data, 16 px, crop ratio 0.875, bicubic: DeiT's default)" in out
    r = json.loads((tmp_path / "r.json").read_text())
    assert r["format"] == "ffcv" and r["images"] == 200 and r["checkpoint"] == str(weights[0])
    assert [c["images"] for c in r["per_class"]] == [20] * 10
    wnids = json.loads((fm_ffcv / "manifest.json").read_text())["classes"]
    assert [c["class"] for c in r["per_class"]] == wnids


def test_results_file_matches_the_images_counted_one_by_one(weights, fm_tree, fm_wds, tmp_path, capsys):
    path, model = weights
    out = _eval(capsys, path, fm_tree, "--results-file", str(tmp_path / "tree.json"))
    assert "imagefolder data" in out
    r = json.loads((tmp_path / "tree.json").read_text())
    # the reference: every validation image through the model, counted per class here
    loader = build_loader(DataConfig(format="imagefolder", train_path=str(fm_tree), val_path=str(fm_tree),
                                     num_workers=0), LoaderSpec("val", 16, 64))
    correct, seen = torch.zeros(10), torch.zeros(10)
    with torch.no_grad():
        for x, y in loader.epoch(0):
            hit = model(x).argmax(1) == y
            correct.index_add_(0, y, hit.float())
            seen.index_add_(0, y, torch.ones(len(y)))
    assert r["images"] == int(seen.sum()) == 200
    assert [c["images"] for c in r["per_class"]] == seen.int().tolist()
    assert [c["top1"] for c in r["per_class"]] == pytest.approx((100 * correct / seen).tolist())
    assert r["top1"] == pytest.approx(100 * correct.sum().item() / 200)
    assert set(r) >= {"top1", "top5", "images", "per_class", "checkpoint", "model", "format"}
    # a WebDataset folder, by its manifest: the same images, the same numbers
    _eval(capsys, path, fm_wds, "--results-file", str(tmp_path / "wds.json"))
    w = json.loads((tmp_path / "wds.json").read_text())
    assert w["format"] == "wds" and w["top1"] == pytest.approx(r["top1"]) and w["per_class"] == r["per_class"]


@pytest.mark.parametrize("cmd", [["eval"], ["analyze", "--out", "OUT"]])
def test_data_that_is_no_known_format_is_refused_before_the_model_loads(cmd, weights, tmp_path, capsys):
    (tmp_path / "notes").mkdir()
    argv = [a.replace("OUT", str(tmp_path / "analysis")) for a in cmd]
    assert main([*argv, "--checkpoint", str(tmp_path / "missing.pth"), "--data", str(tmp_path / "notes")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and f"{tmp_path / 'notes'}: neither a `convit-scale prep` output" in err[0], err
    assert not (tmp_path / "analysis").exists()


def test_results_file_that_is_a_folder_is_refused(weights, fm_tree, tmp_path, capsys):
    assert main(["eval", "--checkpoint", str(weights[0]), "--model", "convit_nano", "--data", str(fm_tree),
                 "--results-file", str(tmp_path)]) == 2
    assert f"--results-file {tmp_path} is a folder" in capsys.readouterr().err


@pytest.fixture(scope="module")
def run(fm_tree, tmp_path_factory):
    """A short run whose evaluation is not DeiT's default view (crop ratio 1.0, bilinear, as the demo's recipe)."""
    from support import records, tiny_recipe, train_here

    tmp = tmp_path_factory.mktemp("eval_run")
    out = tmp / "run"
    recipe = tiny_recipe(tmp / "r.yaml", "imagefolder", fm_tree, out, schedule={"epochs": 2, "warmup_epochs": 1},
                         data={"eval_crop_ratio": 1.0, "interpolation": "bilinear", "eval_batch_size": 50})
    assert train_here(recipe) == 0
    return out, records(out, "eval")


def _results(capsys, tmp_path, checkpoint, data, *extra) -> tuple[dict, str]:
    path = tmp_path / f"r{len(list(tmp_path.glob('r*.json')))}.json"
    assert main(["eval", "--checkpoint", str(checkpoint), "--data", str(data), "--workers", "0", "--device", "cpu",
                 "--results-file", str(path), *extra]) == 0
    return json.loads(path.read_text()), capsys.readouterr().out


def test_eval_of_a_run_reports_the_top1_the_run_logged(run, fm_tree, tmp_path, capsys):
    """Before: eval built its view from DeiT's defaults (0.875, bicubic) and reported another top-1 than the run
    logged for the same weights; a run folder was refused."""
    out, evals = run
    last, best = evals[-1], max(evals, key=lambda e: e["top1"])
    r, printed = _results(capsys, tmp_path, out, fm_tree)  # the run folder: its newest checkpoint
    assert r["checkpoint"].startswith(str(out / "checkpoints" / "step_")) and r["model"] == "convit_nano"
    assert (r["eval_crop_ratio"], r["interpolation"], r["view_from"]) == (1.0, "bilinear", "the checkpoint's")
    assert r["top1"] == pytest.approx(last["top1"]) and r["top5"] == pytest.approx(last["top5"])
    assert "crop ratio 1, bilinear: the checkpoint's" in printed
    b, _ = _results(capsys, tmp_path, f"{out}:best", fm_tree)
    assert b["checkpoint"] == str(out / "checkpoints" / "best") and b["top1"] == pytest.approx(best["top1"])
    assert (b["eval_crop_ratio"], b["interpolation"]) == (1.0, "bilinear")  # best/'s weights file says it too
    # the exported file carries the view in its metadata
    assert main(["export", "--checkpoint", f"{out}:latest", "--out", str(tmp_path / "m.safetensors")]) == 0
    e, _ = _results(capsys, tmp_path, tmp_path / "m.safetensors", fm_tree)
    assert (e["eval_crop_ratio"], e["interpolation"], e["top1"]) == (1.0, "bilinear", r["top1"])
    # a flag changes the view, and says so
    d, _ = _results(capsys, tmp_path, out, fm_tree, "--crop-ratio", "0.875", "--interpolation", "bicubic")
    assert (d["eval_crop_ratio"], d["interpolation"]) == (0.875, "bicubic")
    assert d["view_from"] == "the checkpoint's, --crop-ratio and --interpolation"
    assert d["loss"] != pytest.approx(r["loss"], rel=1e-6)  # other pixels: DeiT's view is not the run's


def test_eval_at_another_size_builds_the_model_there_or_refuses_in_one_line(run, fm_tree, tmp_path, capsys):
    """Before: --img-size 32 on a model trained at 16 ended in an AssertionError traceback."""
    out, _ = run
    r, printed = _results(capsys, tmp_path, out, fm_tree, "--img-size", "32")
    assert r["img_size"] == 32 and r["images"] == 200 and "32 px" in printed
    assert main(["eval", "--checkpoint", str(out), "--data", str(fm_tree), "--img-size", "18"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["error: --img-size 18: not a multiple of the model's patch size 4; allowed: a multiple of 4 (the "
                   "model's own: 16)"], err
    assert main(["eval", "--checkpoint", f"{out}:nope", "--data", str(fm_tree)]) == 2
    assert main(["eval", "--checkpoint", f"{tmp_path}:best", "--data", str(fm_tree)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 2 and "checkpoint not found" in err[0] and "is not a run folder (no checkpoints/)" in err[1]


def test_head_size_flags_against_weights_alone(weights, fm_tree, tmp_path, capsys):
    """Before: --img-size stopped eval from reading the classes from the weights' head (`head.bias: file (10,) vs
    model (1000,)`); --num-classes 1000 on 10-class weights was refused as a shape mismatch of keys, not named; the
    results file said "num_classes": null; export of a missing checkpoint said "no meta.json"."""
    path = weights[0]
    r, printed = _results(capsys, tmp_path, path, fm_tree, "--model", "convit_nano", "--img-size", "32")
    assert r["img_size"] == 32 and r["num_classes"] == 10 and r["images"] == 200
    assert main(["eval", "--checkpoint", str(path), "--model", "convit_nano", "--data", str(fm_tree),
                 "--num-classes", "1000"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"error: --num-classes 1000: the weights in {path} have a head of 10 classes; allowed: 10, or "
                   f"leave --num-classes out (the weights' own)"], err
    missing = tmp_path / "no_such_run"
    assert main(["export", "--checkpoint", str(missing), "--out", str(tmp_path / "m.safetensors")]) == 2
    err = capsys.readouterr().err
    assert f"{missing} does not exist" in err and "meta.json" not in err.split("allowed")[0]


def test_eval_of_a_val_only_tree_scores_the_images_it_decodes(weights, fm_tree, tmp_path, capsys):
    """`eval --data /data/imagenet/val` as timm's validate.py users run it: class folders directly in --data, the
    classes read from them (sorted, as torchvision's ImageFolder). Before: refused ("source has no train folder");
    and an undecodable JPEG was replaced by another image and counted, and nothing said so."""
    import shutil

    val = tmp_path / "val"
    shutil.copytree(fm_tree / "val", val)
    classes = sorted(p.name for p in val.iterdir() if p.is_dir())
    broken = sorted((val / "dress").iterdir())[5]
    broken.write_bytes(broken.read_bytes()[:40])  # the JPEG's header alone: it does not decode
    out = _eval(capsys, weights[0], val, "--results-file", str(tmp_path / "r.json"))
    r = json.loads((tmp_path / "r.json").read_text())
    assert r["format"] == "imagefolder" and r["images"] == 199 and r["undecodable"] == [str(broken)]
    assert [c["class"] for c in r["per_class"]] == classes
    assert [c["images"] for c in r["per_class"]] == [19 if c == broken.parent.name else 20 for c in classes]
    assert "(199 images on cpu, imagefolder data" in out and f"1 undecodable image(s) not scored: {broken}" in out
    # the 199 images scored are the 199 that decode: the same numbers as the tree without the broken file
    broken.unlink()
    r2 = json.loads((tmp_path / "r.json").read_text()) if _eval(
        capsys, weights[0], val, "--results-file", str(tmp_path / "r.json")) else None
    assert r2["images"] == 199 and r2["undecodable"] == [] and r2["top1"] == pytest.approx(r["top1"])
    assert r2["per_class"] == r["per_class"] and r2["loss"] == pytest.approx(r["loss"])


def test_undecodable_images_on_two_ranks(weights, fm_tree, tmp_path, capsys):
    """Sharded over 2 ranks (gloo; 199 images: one rank's share padded), the evaluation scores the same images as on
    one and names the undecodable one on every rank."""
    import os
    import shutil
    import subprocess

    from support import REPO, torchrun_cmd

    val = tmp_path / "val"
    shutil.copytree(fm_tree / "val", val)
    (val / "bag" / "extra.JPEG").write_bytes((sorted((val / "bag").iterdir())[0]).read_bytes())  # 201 files
    broken = sorted((val / "sandal").iterdir())[7]
    broken.write_bytes(b"\xff\xd8\xff\xe0 not a JPEG")
    _eval(capsys, weights[0], val, "--results-file", str(tmp_path / "one.json"))
    one = json.loads((tmp_path / "one.json").read_text())
    out = tmp_path / "ranks"
    out.mkdir()
    res = subprocess.run(torchrun_cmd(2, str(REPO / "tests" / "dist_eval_check.py"), str(weights[0]), str(val),
                                      str(out)), capture_output=True, text=True, cwd=REPO,
                         env={**os.environ, "OMP_NUM_THREADS": "1"}, timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    ranks = [json.loads((out / f"rank{r}.json").read_text()) for r in range(2)]
    assert ranks[0] == ranks[1]
    assert one["images"] == ranks[0]["samples"] == 200 and ranks[0]["undecodable"] == [str(broken)]
    assert ranks[0]["top1"] == pytest.approx(one["top1"]) and ranks[0]["loss"] == pytest.approx(one["loss"])
    assert [c["images"] for c in ranks[0]["per_class"]] == [c["images"] for c in one["per_class"]]
