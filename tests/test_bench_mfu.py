"""`bench mfu` (convit_scale/bench/mfu.py) over the models' forward FLOPs."""

import math


def test_mfu_bench_counts_three_forwards_of_model_flops(tmp_path):
    """`bench mfu`: a real training step per model, FLOPs counted (DeiT-S: 4.6 GMACs per forward, as timm
    reports), achieved = images/s x 3 x forward FLOPs, MFU = achieved / peak."""
    import json

    from convit_scale.cli import main
    from convit_scale.models import forward_flops

    assert math.isclose(forward_flops("deit_small") / 2e9, 4.6, rel_tol=0.01)
    assert forward_flops("convit_small") > forward_flops("deit_small")
    assert main(["bench", "mfu", "--device", "cpu", "--precision", "fp32", "--models", "convit_nano", "--batch", "2",
                 "--steps", "1", "--warmup", "1", "--peak-tflops", "2", "--out", str(tmp_path)]) == 0
    r = json.loads((tmp_path / "bench_mfu.json").read_text())["results"]["convit_nano"]
    flops = 3 * forward_flops("convit_nano")
    assert math.isclose(r["train_gflops_per_image"], flops / 1e9)
    assert r["images_per_s"] > 0 and math.isclose(r["achieved_tflops"], r["images_per_s"] * flops / 1e12)
    assert math.isclose(r["mfu"], r["achieved_tflops"] / 2)
