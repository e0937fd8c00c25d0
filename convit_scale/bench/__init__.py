"""`convit-scale bench model|data|memory|distill|mfu`: the numbers in BENCHMARKS.md, measured side by side.

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


def _run(args) -> dict:
    out = Path(args.out)
    if args.what == "model":
        from .model import bench_model

        return bench_model(args.batch or 8, args.steps, args.rounds, args.device, args.precision)
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
                         args.precision, args.peak_tflops, args.compile)
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
    p = sub.add_parser("bench", help="benchmarks for BENCHMARKS.md (model, data, memory, distill, mfu)")
    p.add_argument("what", choices=["model", "data", "memory", "distill", "mfu"])
    p.add_argument("--out", default="runs/bench")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--precision", default="bf16" if torch.cuda.is_available() else "fp32", choices=["fp32", "bf16"])
    p.add_argument("--batch", type=int, help="images per step (model: 8, distill: 4, mfu: 64)")
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--seconds", type=float, default=8.0, help="data: seconds per candidate and round")
    p.add_argument("--model", default="convit_base_plus", help="memory: the model")
    p.add_argument("--img-size", type=int, default=64, help="memory: input size (model state dominates)")
    p.add_argument("--worlds", default="1,2,4", help="memory: world sizes")
    p.add_argument("--strategies", default="ddp,fsdp2,zero1,zero2,zero3", help="memory: strategies")
    p.add_argument("--models", default="convit_small_plus,convit_base_plus", help="mfu: models")
    p.add_argument("--warmup", type=int, default=3, help="mfu: untimed steps first")
    p.add_argument("--peak-tflops", type=float, help="mfu: the device's dense peak (default: known GPUs' bf16 peak)")
    p.add_argument("--compile", action="store_true", help="mfu: torch.compile each block")
    p.set_defaults(func=_cmd_bench)
