"""`bench inference`: Table 1's speed column (batch 128, 224, fp32 by default), ConViT beside DeiT in one run."""

import argparse

from convit_scale.bench import _precision, inference


def test_inference_bench_sets_convit_beside_deit_and_the_paper():
    out = inference.bench_inference(["tiny"], batch=2, steps=1, warmup=0, rounds=1, device="cpu", precision="fp32")
    row = out["results"]["tiny"]
    assert row["deit_images_per_s"] > 0 and row["convit_images_per_s"] > 0
    assert row["convit_vs_deit"] == row["convit_images_per_s"] / row["deit_images_per_s"]
    assert (row["paper_deit"], row["paper_convit"]) == (1442, 734)  # Table 1, Quadro GP100
    assert out["precision"] == "fp32" and out["batch"] == 2


def test_inference_defaults_are_the_papers():
    """fp32 on any device unless asked (the paper's inference is fp32); the training benches keep bf16 on GPUs."""
    from convit_scale.cli import build_parser

    args = build_parser().parse_args(["bench", "inference", "--device", "cuda"])
    assert _precision(args) == "fp32" and args.batch is None  # None: 128 in bench_inference's call
    assert args.sizes.split(",") == list(inference.SIZES)
    assert _precision(argparse.Namespace(what="model", precision=None, device="cuda")) == "bf16"
    assert _precision(argparse.Namespace(what="inference", precision="bf16", device="cuda")) == "bf16"
