"""`convit-scale bench model|data|memory|distill|mfu|inference|pixels|universal|gate|saves|startup`: the numbers in
BENCHMARKS.md, measured side by side.

Every benchmark runs its candidates in the same command, on the same inputs, and reports ratios to a
reference measured in that run. Each candidate runs in a fresh subprocess (``python -m convit_scale.bench
KIND SPEC``: peak memory is then its own), in interleaved rounds (A B C A B C), and the best round is kept.
One module per benchmark, imported only when it runs (``bench data`` and ``bench pixels`` import FFCV, which a GPU
machine may lack: the other benchmarks run without it); ``worker`` holds the subprocess and the timed training step
they share.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import torch


def _resolve(args) -> None:
    """``auto`` device and precision: the GPU in bf16 when there is one, else the CPU in fp32."""

    if args.device == "auto":
        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    if args.precision == "auto":  # Table 1's speed column is fp32 inference
        args.precision = "bf16" if args.what != "inference" and args.device.startswith("cuda") else "fp32"


def _run(args) -> dict:
    out, precision = Path(args.out), args.precision
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

        return pixel_fidelity([Path(p) for p in args.photos] if args.photos else _sample_photographs(), args.boxes,
                              device=args.device)
    if args.what == "data":
        from .data import bench_calibrate, bench_crop_decode, bench_data, bench_stages

        if args.calibrate:
            return bench_calibrate(out / "data_work", args.seconds)
        if args.stages:
            return bench_stages(out / "data_work", args.seconds, args.rounds)
        if args.decode_only:
            return bench_crop_decode(out / "data_work", args.seconds, args.rounds)
        return bench_data(out / "data_work", args.seconds, args.rounds, args.device)
    if args.what == "memory":
        from .memory import bench_memory

        return bench_memory(out / "memory_work", args.model, args.img_size,
                            [int(w) for w in (args.worlds or "1,2,4").split(",")],
                            (args.strategies or "ddp,fsdp2,zero1,zero2,zero3").split(","))
    if args.what == "universal":
        from .universal import bench_universal

        return bench_universal(out / "universal_work", args.model, args.img_size,
                               [int(w) for w in (args.worlds or "2").split(",")],
                               (args.strategies or "zero2,zero3").split(","))
    if args.what == "saves":
        from .saves import bench_saves

        return bench_saves(out / "saves_work", args.model, args.img_size, int((args.worlds or "2").split(",")[0]),
                           (args.strategies or "ddp,fsdp2,zero2").split(","), args.steps, 2, args.rounds)
    if args.what == "startup":
        from .startup import bench_startup

        return bench_startup(out / "startup_work", args.rounds)
    if args.what == "gate":
        from .gate import bench_gate

        return bench_gate(args.model, args.img_size, args.batch or 8, args.steps,
                          (args.strategies or "zero2,zero3").split(","), args.device, precision)
    if args.what == "mfu":
        from .mfu import bench_mfu

        return bench_mfu(args.models.split(","), args.batch or 64, args.steps, args.warmup, args.device,
                         precision, args.peak_tflops, args.compile)
    from .distill import bench_distill

    return bench_distill(args.batch or 4, args.steps, args.rounds, args.device)


def run_bench(args) -> int:
    """`convit-scale bench WHAT`: run one benchmark, write OUT/bench_WHAT.json and print it."""

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    _resolve(args)
    res = _run(args)
    res["command"] = "convit-scale " + " ".join(sys.argv[1:])
    res["torch"] = torch.__version__
    res["cpus"] = os.cpu_count()
    path = out / f"bench_{args.what}.json"
    path.write_text(json.dumps(res, indent=1))
    print(json.dumps(res, indent=1))
    print(f"wrote {path}")
    return 0
