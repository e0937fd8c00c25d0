"""`bench inference`: Table 1's speed column (batch 128, 224, fp32 by default), ConViT beside DeiT in one run."""

import argparse

from convit_scale.bench import _resolve, inference


def test_the_worker_times_forwards_without_gradients():
    r = inference.worker({"model": "convit_tiny", "batch": 2, "steps": 1, "warmup": 0, "device": "cpu",
                          "precision": "fp32"})
    assert r["images_per_s"] > 0 and r["img_size"] == 224  # Table 1's resolution


def test_inference_bench_sets_convit_beside_deit_and_the_paper(monkeypatch):
    calls = []

    def fake_run(kind, spec, memory=False):
        calls.append((kind, spec["model"], spec["batch"], spec["precision"]))
        return {"images_per_s": {"deit_tiny": 100.0, "convit_tiny": 50.0}[spec["model"]] + len(calls)}

    monkeypatch.setattr(inference, "run_worker", fake_run)
    out = inference.bench_inference(["tiny"], batch=128, steps=1, warmup=0, rounds=2, device="cpu", precision="fp32")
    assert calls[:2] == [("inference", "deit_tiny", 128, "fp32"), ("inference", "convit_tiny", 128, "fp32")]
    row = out["results"]["tiny"]  # the best of the 2 interleaved rounds of each
    assert (row["deit_images_per_s"], row["convit_images_per_s"]) == (103.0, 54.0)
    assert row["convit_vs_deit"] == 54.0 / 103.0 and (row["paper_deit"], row["paper_convit"]) == (1442, 734)


def test_inference_defaults_are_the_papers():
    """fp32 on any device unless asked (the paper's inference is fp32); the training benches keep bf16 on GPUs."""
    from convit_scale.cli import build_parser

    def resolved(**kw):
        args = argparse.Namespace(**kw)
        _resolve(args)
        return args.precision

    args = build_parser().parse_args(["bench", "inference", "--device", "cuda"])
    assert args.precision == "auto" and args.batch is None  # None: 128 in bench_inference's call
    assert resolved(what="inference", precision="auto", device="cuda") == "fp32"
    assert args.sizes.split(",") == list(inference.SIZES)
    assert resolved(what="model", precision="auto", device="cuda") == "bf16"
    assert resolved(what="inference", precision="bf16", device="cuda") == "bf16"
