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
    assert "(200 images on cpu, ffcv data)" in out
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
