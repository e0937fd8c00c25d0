"""``convit-scale bench``: the benchmarks of BENCHMARKS.md (they live in convit_scale/bench/)."""

from __future__ import annotations

from .argtypes import non_negative_int, positive_float, positive_int

KINDS = ("model", "data", "memory", "distill", "mfu", "inference", "pixels", "universal", "gate", "saves", "startup")
"""The benchmarks, one module each in convit_scale/bench/ (imported only when one runs: they import torch)."""


def _cmd_bench(args) -> int:
    from ..bench import run_bench

    return run_bench(args)


def register(sub) -> None:
    p = sub.add_parser("bench", help="benchmarks for BENCHMARKS.md (model, data, memory, distill, mfu, inference, "
                                     "pixels, universal, gate, saves, startup)",
                       description="Measure candidates side by side, each in a fresh process, in interleaved rounds; "
                                   "writes OUT/bench_WHAT.json. `bench data` needs the bench extra "
                                   "(pip install -e '.[bench]').")
    p.add_argument("what", choices=KINDS, help="which benchmark (BENCHMARKS.md has one section per kind)")
    p.add_argument("--out", default="runs/bench", help="folder for bench_WHAT.json and the benchmarks' work files")
    p.add_argument("--device", default="auto", help="auto (cuda when there is a GPU, else cpu), cpu, cuda or cuda:N")
    p.add_argument("--precision", default="auto", choices=["auto", "fp32", "bf16"],
                   help="auto: fp32 for inference (Table 1's speed column), else bf16 on a GPU and fp32 on the CPU")
    p.add_argument("--batch-size", "--batch", dest="batch", type=positive_int,
                   help="images per step (default model: 8, distill: 4, mfu: 64, inference: 128)")
    p.add_argument("--steps", type=positive_int, default=3,
                   help="model, distill, mfu: timed steps per round; saves: the run's steps (a save every 2)")
    p.add_argument("--rounds", type=positive_int, default=2,
                   help="model, data, distill, saves, startup: interleaved rounds (A B C A B C); the best round is "
                        "kept")
    p.add_argument("--seconds", type=positive_float, default=8.0, help="data: seconds per candidate and round")
    p.add_argument("--stages", action="store_true",
                   help="data: only the loaders' CPU ms per image by format and mode, and its stages (read, decode, "
                        "resize, augment), against the whole JPEG's decode in the same run")
    p.add_argument("--calibrate", action="store_true",
                   help="data: measure this node's JPEG decode for a few seconds (--seconds) and write it where "
                        "`convit-scale plan` reads it (CONVIT_SCALE_CALIBRATION, default "
                        "~/.cache/convit-scale/calibration.json)")
    p.add_argument("--decode-only", action="store_true",
                   help="data: only the train crop's JPEG decode, whole image against the crop box alone")
    p.add_argument("--model", default="convit_base_plus", help="memory, universal, gate, saves: the model")
    p.add_argument("--img-size", type=positive_int, default=64,
                   help="memory, universal, gate, saves: input size (model state dominates)")
    p.add_argument("--worlds", help="memory (default 1,2,4), universal (default 2), saves (default 2: the first): "
                                    "comma-separated world sizes")
    p.add_argument("--strategies", help="memory (default ddp,fsdp2,zero1,zero2,zero3), universal and gate (default "
                                        "zero2,zero3), saves (default ddp,fsdp2,zero2): comma-separated strategies")
    p.add_argument("--models", default="convit_small_plus,convit_base_plus", help="mfu: comma-separated models")
    p.add_argument("--warmup", type=non_negative_int, default=3, help="mfu, inference: untimed steps first")
    p.add_argument("--sizes", default="tiny,tiny_plus,small,small_plus,base,base_plus",
                   help="inference: Table 1's sizes, each as DeiT and ConViT")
    p.add_argument("--photos", nargs="+", help="pixels: JPEG photographs (default: scikit-learn's two)")
    p.add_argument("--boxes", type=positive_int, default=200, help="pixels: crop boxes per photograph")
    p.add_argument("--peak-tflops", type=positive_float,
                   help="mfu: the device's dense peak (default: the known GPUs' bf16 peak, convit_scale/hardware.py)")
    p.add_argument("--compile", action="store_true", help="mfu: torch.compile each block")
    p.set_defaults(func=_cmd_bench)
