"""`convit-scale bench model|data|memory|distill|mfu|inference|pixels`: the numbers in BENCHMARKS.md, measured
side by side.

Every benchmark runs its candidates in the same command, on the same inputs, and reports ratios to a
reference measured in that run. Each candidate runs in a fresh subprocess (``python -m convit_scale.bench
KIND SPEC``: peak memory is then its own), in interleaved rounds (A B C A B C), and the best round is kept.
One module per benchmark; ``worker`` holds the subprocess and the timed training step they share.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import torch


def _precision(args) -> str:
    """--precision, else: fp32 for inference (Table 1's speed column is fp32), bf16 on CUDA, fp32 on the CPU."""
    if args.precision:
        return args.precision
    return "bf16" if args.what != "inference" and args.device.startswith("cuda") else "fp32"


def _run(args) -> dict:
    out, precision = Path(args.out), _precision(args)
    if args.what == "model":
        from .model import bench_model

        return bench_model(args.batch or 8, args.steps, args.rounds, args.device, precision)
    if args.what == "inference":
        from .inference import bench_inference

        return bench_inference(args.sizes.split(","), args.batch or 128, args.steps, args.warmup, args.rounds,
                               args.device, precision)
    if args.what == "pixels":
        from .data import _sample_photographs
        from .pixels import pixel_fidelity

        return pixel_fidelity([Path(p) for p in args.photos] if args.photos else _sample_photographs(), args.boxes)
    if args.what == "data":
        from .data import bench_data

        return bench_data(out / "data_work", args.seconds, args.rounds, args.device)
    if args.what == "memory":
        from .memory import bench_memory

        return bench_memory(out / "memory_work", args.model, args.img_size, [int(w) for w in args.worlds.split(",")],
                            args.strategies.split(","))
    if args.what == "mfu":
        from .mfu import bench_mfu

        return bench_mfu(args.models.split(","), args.batch or 64, args.steps, args.warmup, args.device,
                         precision, args.peak_tflops, args.compile)
    from .distill import bench_distill

    return bench_distill(args.batch or 4, args.steps, args.rounds, args.device)


def _cmd_bench(args) -> int:
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    res = _run(args)
    res["command"] = "convit-scale " + " ".join(sys.argv[1:])
    res["torch"] = torch.__version__
    res["cpus"] = os.cpu_count()
    path = out / f"bench_{args.what}.json"
    path.write_text(json.dumps(res, indent=1))
    print(json.dumps(res, indent=1))
    print(f"wrote {path}")
    return 0


def add_subcommand(sub) -> None:
    p = sub.add_parser("bench", help="benchmarks for BENCHMARKS.md (model, data, memory, distill, mfu, inference, "
                                     "pixels)")
    p.add_argument("what", choices=["model", "data", "memory", "distill", "mfu", "inference", "pixels"])
    p.add_argument("--out", default="runs/bench")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--precision", choices=["fp32", "bf16"],
                   help="default: fp32 for inference (Table 1), else bf16 on CUDA and fp32 on the CPU")
    p.add_argument("--batch", type=int, help="images per step (model: 8, distill: 4, mfu: 64, inference: 128)")
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--seconds", type=float, default=8.0, help="data: seconds per candidate and round")
    p.add_argument("--model", default="convit_base_plus", help="memory: the model")
    p.add_argument("--img-size", type=int, default=64, help="memory: input size (model state dominates)")
    p.add_argument("--worlds", default="1,2,4", help="memory: world sizes")
    p.add_argument("--strategies", default="ddp,fsdp2,zero1,zero2,zero3", help="memory: strategies")
    p.add_argument("--models", default="convit_small_plus,convit_base_plus", help="mfu: models")
    p.add_argument("--warmup", type=int, default=3, help="mfu, inference: untimed steps first")
    p.add_argument("--sizes", default=",".join(("tiny", "tiny_plus", "small", "small_plus", "base", "base_plus")),
                   help="inference: Table 1's sizes, each as DeiT and ConViT")
    p.add_argument("--photos", nargs="+", help="pixels: JPEG photographs (default: scikit-learn's two)")
    p.add_argument("--boxes", type=int, default=200, help="pixels: crop boxes per photograph")
    p.add_argument("--peak-tflops", type=float, help="mfu: the device's dense peak (default: known GPUs' bf16 peak)")
    p.add_argument("--compile", action="store_true", help="mfu: torch.compile each block")
    p.set_defaults(func=_cmd_bench)
