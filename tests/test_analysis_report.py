"""`analyze`: masking on the whole validation split, and layer-by-layer CKA against a ResNet from a local file."""

import json

import torch

from convit_scale import create_model
from convit_scale.analysis.attention import attention_maps, gating, nonlocality
from convit_scale.analysis.report import analyze


def _resnet_file(path):
    """A timm ResNet with random weights in a local file: nothing downloads."""
    import timm
    from safetensors.torch import save_file

    torch.manual_seed(0)
    save_file(timm.create_model("resnet10t", pretrained=False, num_classes=10).state_dict(), str(path))
    return path


def test_analyze_masks_any_layer_on_all_images_and_compares_with_a_resnet(fm_wds, tmp_path, capsys):
    from safetensors.torch import save_file

    from convit_scale.cli import main

    weights = tmp_path / "m.safetensors"
    save_file(create_model("convit_nano", num_classes=10).state_dict(), str(weights))
    resnet = _resnet_file(tmp_path / "resnet10t.safetensors")
    out = tmp_path / "analysis"
    argv = ["analyze", "--checkpoint", str(weights), "--model", "convit_nano", "--data", str(fm_wds),
            "--format", "wds", "--out", str(out), "--images", "40", "--device", "cpu"]
    assert main([*argv, "--masking", "last", "0", "--masking-images", "all", "--compare", str(resnet),
                 "--compare-model", "resnet10t"]) == 0
    r = json.loads((out / "analysis.json").read_text())
    assert r["images"] == 40 and r["masking_images"] == 200  # the whole validation split, streamed
    assert set(r["masking_top1"]) == {"none", "position_embedding", "content_attention_last",
                                      "position_attention_last", "content_attention_layers_0",
                                      "position_attention_layers_0"}
    # every block of the ConViT (rows) against every residual block of the ResNet (columns), as a heatmap
    assert r["compare_layers"] == ["layer1.0", "layer2.0", "layer3.0", "layer4.0"]
    cka = torch.tensor(r["cka_compare"])
    assert cka.shape == (3, 4) and bool(((cka > -0.2) & (cka < 1.0 + 1e-6)).all())
    assert (out / "cka_compare.png").stat().st_size > 1000 and "compare_nonlocality" not in r
    assert "masking top-1 on 200 images" in capsys.readouterr().out
    assert main([*argv, "--masking-images", "10"]) == 0  # fewer than --images: the first 10 of those in memory
    assert json.loads((out / "analysis.json").read_text())["masking_images"] == 10
    for bad, message in ((["--masking", "2"], "GPSA layers [2], the model has 2"),
                         (["--masking", "middle"], "--masking"),
                         (["--compare", str(resnet), "--compare-model", "resnet_nope"], "resnet_nope")):
        capsys.readouterr()
        assert main([*argv, *bad]) == 2
        (line,) = [x for x in capsys.readouterr().err.splitlines() if x.startswith("error:")]
        assert message in line, line


def test_cka_of_a_resnet_with_itself_is_one_on_the_diagonal():
    import timm

    from convit_scale.analysis.report import cka_matrix

    torch.manual_seed(0)
    cnn = timm.create_model("resnet10t", pretrained=False, num_classes=10).eval()
    batches = [(torch.randn(8, 3, 32, 32), None) for _ in range(2)]
    m = cka_matrix(cnn, cnn, batches)
    assert m.shape == (4, 4) and torch.allclose(m.diagonal(), torch.ones(4, dtype=m.dtype), atol=1e-6)


def test_training_curves_from_a_run_folder_beside_the_papers_top1(tmp_path):
    """Loss and lr against the step, top-1/top-5 against the epoch, the paper's top-1 from the run's config.yaml; a
    bad step (loss null) is left out of the curve."""
    import json

    from convit_scale.analysis import plots
    from convit_scale.analysis.report import curves

    recs = [{"kind": "train", "step": s, "epoch": s // 10, "loss": 2.0 - s / 100, "lr": 1e-4 * s} for s in range(1, 31)]
    recs[4]["loss"] = None
    recs += [{"kind": "eval", "step": 10 * e, "epoch": e - 1, "top1": 20.0 * e, "top5": 50.0 + 10 * e}
             for e in (1, 2, 3)]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs))
    (tmp_path / "config.yaml").write_text("paper: {table: '1', row: ConViT-S, top1: 81.3}\n")
    c = curves(tmp_path)
    assert len(c["step"]) == 29 and 5 not in c["step"] and c["lr"][0] == 1e-4
    assert (c["eval_epoch"], c["top1"], c["paper_top1"]) == ([0, 1, 2], [20.0, 40.0, 60.0], 81.3)
    path = plots.training_curves(c, tmp_path / "training_curves.png")
    assert path.stat().st_size > 5000


def test_report_writes_plots_and_numbers(tmp_path):
    torch.manual_seed(0)
    model = create_model("convit_nano", num_classes=4).eval()
    deit = create_model("deit_nano", num_classes=4).eval()
    batches = [(torch.randn(8, 3, 16, 16), torch.randint(0, 4, (8,))) for _ in range(2)]
    res = analyze(model, batches, tmp_path, compare=deit, names=("convit", "deit"))
    for f in ("gating.png", "nonlocality.png", "attention_maps.png", "attention_distance.png", "cka_self.png",
              "cka_compare.png", "analysis.json"):
        assert (tmp_path / f).stat().st_size > 1000, f
    assert len(res["gating"]) == 2 and len(res["gating"][0]) == 4
    assert len(res["nonlocality"]) == 3
    cka = torch.tensor(res["cka_self"])
    assert torch.allclose(cka.diagonal(), torch.ones(3, dtype=cka.dtype), atol=1e-6)
    assert set(res["masking_top1"]) >= {"none", "position_embedding", "content_attention_first_2"}
    maps = attention_maps(model, batches[0][0])
    assert [m.shape for m in maps] == [(8, 4, 16, 16)] * 3
    assert gating(model) == res["gating"] and nonlocality(model, batches[0][0])[0] > 0
