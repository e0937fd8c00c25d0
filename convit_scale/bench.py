"""`convit-scale bench model|data|memory|distill`: the numbers in BENCHMARKS.md, measured side by side.

Every benchmark runs its candidates in the same command, on the same inputs, and reports ratios to a
reference measured in that run. Each candidate runs in a fresh subprocess (peak memory is then its own),
in interleaved rounds (A B C A B C), and the best round is kept.
"""

from __future__ import annotations

import json
import os
import resource
import shutil
import subprocess
import sys
import time
from pathlib import Path

import torch

from .metrics import read_records

# -- model: training throughput and peak memory -------------------------------------------------------------
MODEL_CANDIDATES = {
    "ours_fast": ("convit_small", "fast"),
    "ours_reference": ("convit_small", "reference"),
    "timm_convit": ("timm:convit_small", None),
    "timm_deit": ("timm:deit_small_patch16_224", None),
    "ours_deit": ("deit_small", None),
}


def _peak_bytes(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device)
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def _model_worker(spec: dict) -> dict:
    """One candidate: forward+backward images/s and peak memory above the process baseline."""
    import timm

    from .models import create_model

    device = torch.device(spec["device"])
    torch.manual_seed(0)
    dtype = torch.bfloat16 if spec["precision"] == "bf16" else None
    x = torch.randn(spec["batch"], 3, 224, 224, device=device)
    y = torch.randint(0, 1000, (spec["batch"],), device=device)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    base = _peak_bytes(device) if device.type == "cuda" else _rss_now()
    name, impl = spec["model"]
    if name.startswith("timm:"):
        model = timm.create_model(name[5:], drop_path_rate=0.0).to(device)
    else:
        model = create_model(name, drop_path_rate=0.0, **({"gpsa_impl": impl} if impl else {})).to(device)
    model.train()

    def step():
        with torch.autocast(device.type, dtype=dtype, enabled=dtype is not None):
            loss = torch.nn.functional.cross_entropy(model(x).float(), y)
        loss.backward()
        model.zero_grad(set_to_none=False)  # keep gradient memory allocated, as in training

    for _ in range(spec["warmup"]):
        step()
    dt = _timed(step, spec["steps"], device)
    return {"images_per_s": spec["batch"] * spec["steps"] / dt, "peak_mb": (_peak_bytes(device) - base) / 2**20}


def _timed(step, n: int, device: torch.device) -> float:
    """Seconds for ``n`` calls of ``step``, with the device's queue drained before and after."""
    if device.type == "cuda":
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(n):
        step()
    if device.type == "cuda":
        torch.cuda.synchronize()
    return time.perf_counter() - t0


def _rss_now() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _run_worker(kind: str, spec: dict) -> dict:
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "1048576"}  # freed memory goes back: RSS is honest
    out = subprocess.run([sys.executable, "-m", "convit_scale.bench", kind, json.dumps(spec)], capture_output=True,
                         text=True, env=env)
    if out.returncode != 0:
        raise RuntimeError(f"benchmark worker failed: {out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def bench_model(batch: int, steps: int, rounds: int, device: str, precision: str) -> dict:
    results: dict[str, dict] = {}
    for _ in range(rounds):
        for key, model in MODEL_CANDIDATES.items():
            r = _run_worker("model", {"model": model, "batch": batch, "steps": steps, "warmup": 1,
                                      "device": device, "precision": precision})
            best = results.get(key)
            results[key] = {"images_per_s": max(r["images_per_s"], best["images_per_s"] if best else 0),
                            "peak_mb": min(r["peak_mb"], best["peak_mb"] if best else float("inf"))}
    ref = results["timm_convit"]
    for r in results.values():
        r["throughput_vs_timm_convit"] = r["images_per_s"] / ref["images_per_s"]
        r["memory_vs_timm_convit"] = r["peak_mb"] / ref["peak_mb"]
    ratios = {
        "convit_vs_deit_ours": results["ours_fast"]["images_per_s"] / results["ours_deit"]["images_per_s"],
        "convit_vs_deit_timm": results["timm_convit"]["images_per_s"] / results["timm_deit"]["images_per_s"],
        "ours_convit_vs_timm_deit": results["ours_fast"]["images_per_s"] / results["timm_deit"]["images_per_s"],
    }
    return {"batch": batch, "steps": steps, "rounds": rounds, "device": device, "precision": precision,
            "results": results, "ratios": ratios}


# -- mfu: one device, a full training step (AdamW), model FLOPs against the device's peak ----------------------
# Dense bf16 tensor-core peaks (TFLOP/s) from the vendors' data sheets; --peak-tflops for anything else.
PEAK_BF16_TFLOPS = {"H200": 989.0, "H100": 989.0, "GH200": 989.0, "A100": 312.0, "L40S": 362.0, "L4": 121.0,
                    "A10": 125.0, "MI300X": 1307.0}


def device_peak_tflops(device: str) -> float | None:
    if not device.startswith("cuda") or not torch.cuda.is_available():
        return None
    name = torch.cuda.get_device_name(torch.device(device)).upper()
    for key in sorted(PEAK_BF16_TFLOPS, key=len, reverse=True):  # "GH200" before "H200"
        if key in name:
            return PEAK_BF16_TFLOPS[key]
    return None


def _train_worker(spec: dict) -> dict:
    """A real training step of one model: forward, backward, AdamW step, zero_grad; images/s and peak memory."""
    from .models import MODELS, create_model

    device = torch.device(spec["device"])
    torch.manual_seed(0)
    dtype = torch.bfloat16 if spec["precision"] == "bf16" else None
    model = create_model(spec["model"], drop_path_rate=0.0).to(device).train()
    if spec.get("compile"):
        for i, block in enumerate(model.blocks):
            model.blocks[i] = torch.compile(block)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=device.type == "cuda")
    size = MODELS[spec["model"]].img_size
    x = torch.randn(spec["batch"], 3, size, size, device=device)
    y = torch.randint(0, 1000, (spec["batch"],), device=device)

    def step():
        with torch.autocast(device.type, dtype=dtype, enabled=dtype is not None):
            loss = torch.nn.functional.cross_entropy(model(x).float(), y)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    for _ in range(spec["warmup"]):
        step()
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    dt = _timed(step, spec["steps"], device)
    peak = torch.cuda.max_memory_allocated(device) / 2**20 if device.type == "cuda" else None
    return {"images_per_s": spec["batch"] * spec["steps"] / dt, "peak_mb": peak}


def bench_mfu(models: list[str], batch: int, steps: int, warmup: int, device: str, precision: str,
              peak_tflops: float | None, compile_blocks: bool = False) -> dict:
    """Training throughput and model FLOPs utilisation: 3 x forward FLOPs per image (counted, not
    estimated) x images/s, over the device's dense peak."""
    from .models import forward_flops

    peak = peak_tflops or device_peak_tflops(device)
    rows = {}
    for name in models:
        r = _run_worker("train", {"model": name, "batch": batch, "steps": steps, "warmup": warmup,
                                  "device": device, "precision": precision, "compile": compile_blocks})
        flops = 3 * forward_flops(name)
        achieved = r["images_per_s"] * flops / 1e12
        rows[name] = {**r, "train_gflops_per_image": flops / 1e9, "achieved_tflops": achieved,
                      "mfu": achieved / peak if peak else None}
    on_gpu = device.startswith("cuda") and torch.cuda.is_available()
    return {"device": device, "device_name": torch.cuda.get_device_name(torch.device(device)) if on_gpu else "cpu",
            "precision": precision, "batch": batch, "steps": steps, "compile": compile_blocks,
            "peak_tflops": peak, "results": rows}


# -- data: loader throughput per core against raw JPEG decode --------------------------------------------------
def make_photo_tree(out: Path, per_class: int = 40, classes: int = 4, seed: int = 0) -> Path:
    """ImageNet-like JPEGs (about 500x375, q90) cut from the two real photographs scikit-learn ships."""
    import numpy as np
    from PIL import Image

    try:
        from sklearn.datasets import load_sample_images
    except ImportError as e:
        raise SystemExit("error: `bench data` needs scikit-learn's sample photographs: pip install -e '.[bench]'") from e
    photos = [Image.fromarray(a) for a in load_sample_images().images]  # 640x427 each
    rng = np.random.default_rng(seed)
    for split, n in (("train", per_class), ("val", max(4, per_class // 4))):
        for c in range(classes):
            d = out / split / f"c{c}"
            d.mkdir(parents=True, exist_ok=True)
            for i in range(n):
                p = photos[(c + i) % 2]
                w, h = int(rng.integers(420, 640)), int(rng.integers(300, 427))
                x0, y0 = int(rng.integers(0, 640 - w + 1)), int(rng.integers(0, 427 - h + 1))
                img = p.crop((x0, y0, x0 + w, y0 + h)).resize((500, 375), Image.BICUBIC)
                if i % 2:
                    img = img.transpose(Image.FLIP_LEFT_RIGHT)
                img.save(d / f"{i:04d}.JPEG", quality=90)
    return out


def _data_worker(spec: dict) -> dict:
    """Images/s of one loader on one core (workers 0: everything in this process), or of raw decode."""
    import io

    from PIL import Image

    torch.set_num_threads(1)
    if spec["loader"] == "decode":
        files = sorted(Path(spec["tree"], "train").rglob("*.JPEG"))
        blobs = [f.read_bytes() for f in files]
        t0 = time.perf_counter()
        n = 0
        while time.perf_counter() - t0 < spec["seconds"]:
            for b in blobs:
                Image.open(io.BytesIO(b)).convert("RGB").load()
                n += 1
        return {"images_per_s": n / (time.perf_counter() - t0)}
    from .config import DataConfig
    from .data import LoaderSpec, build_loader

    full = spec["transform"] == "full"
    d = DataConfig(format=spec["loader"], train_path=spec["path"], val_path=spec["path"], num_workers=0,
                   repeated_aug=1, rand_augment="rand-m9-mstd0.5-inc1" if full else None,
                   color_jitter=0.4 if full else 0.0, reprob=0.25 if full else 0.0)
    if spec["loader"] == "ffcv":
        d.num_workers = 1  # FFCV decodes in its own thread pool: one thread
    loader = build_loader(d, LoaderSpec("train", 224, 16))
    n, epoch = 0, 0
    for _ in loader.epoch(99):  # warm-up: numba compilation, file cache
        break
    t0 = time.perf_counter()
    while time.perf_counter() - t0 < spec["seconds"]:
        for x, _ in loader.epoch(epoch):
            n += len(x)
        epoch += 1
    return {"images_per_s": n / (time.perf_counter() - t0)}


def bench_data(work: Path, seconds: float, rounds: int) -> dict:
    from data_prep import PrepOptions, prepare

    tree = make_photo_tree(work / "tree")
    paths = {"imagefolder": tree,
             "wds": work / "wds", "ffcv": work / "ffcv"}
    prepare(tree, paths["wds"], PrepOptions(fmt="wds", shard_size=40, workers=2))
    prepare(tree, paths["ffcv"], PrepOptions(fmt="ffcv", workers=2))
    cands = [("decode", None)] + [(l, t) for l in ("imagefolder", "wds", "ffcv") for t in ("crop_flip", "full")]
    best: dict[str, float] = {}
    for _ in range(rounds):
        for loader, transform in cands:
            key = loader if transform is None else f"{loader}/{transform}"
            r = _run_worker("data", {"loader": loader, "transform": transform, "tree": str(tree),
                                     "path": str(paths.get(loader, tree)), "seconds": seconds})
            best[key] = max(best.get(key, 0.0), r["images_per_s"])
    raw = best["decode"]
    return {"seconds": seconds, "rounds": rounds,
            "results": {k: {"images_per_s": v, "vs_raw_decode": v / raw} for k, v in best.items()}}


# -- memory: peak per rank of each strategy against the ideal -------------------------------------------------
def bench_memory(work: Path, model: str, img_size: int, worlds: list[int], strategies: list[str]) -> dict:
    """Per strategy and world size, per rank: the model state (memory of live tensors after backward, once
    the optimizer moments exist), the peak RSS during a few real training steps and the peak of set-up,
    both above the process baseline before the model exists."""
    from data_prep.fashion_mnist import build_tree

    from .train.launch import run_recipe
    from .models import create_model

    tree = build_tree(work / "tree", {"train": 20, "val": 4})
    params = sum(p.numel() for p in create_model(model, device="meta").parameters())
    rows = []
    for world in worlds:
        for s in strategies:
            out = work / f"{s}_{world}"
            overrides = [f"model.name={model}", f"model.img_size={img_size}", "model.num_classes=10",
                         "data.format=imagefolder", f"data.train_path={tree}", "data.val_path=",
                         f"data.global_batch_size={2 * world}", "data.num_workers=0", "data.repeated_aug=1",
                         f"parallel.strategy={'none' if world == 1 and s == 'ddp' else s}", "parallel.precision=fp32",
                         "schedule.max_steps=2", "log.every_steps=1", "log.progress=false",
                         "checkpoint.resume=none", f"run.output_dir={out}"]
            recipe = str(Path(__file__).resolve().parents[1] / "recipes" / "cpu" / "demo.yaml")
            env = {"MALLOC_MMAP_THRESHOLD_": "1048576"}
            rc = run_recipe(recipe, overrides, world, env=env, quiet=world == 1)
            recs = read_records(out) if rc == 0 else []
            shutil.rmtree(out / "checkpoints", ignore_errors=True)  # 2 GB per configuration, not needed
            train = [r for r in recs if r["kind"] == "train"]
            if not train:
                rows.append({"strategy": s, "world": world, "error": f"exit {rc}"})
                continue
            peak = max(train[-1]["peak_mem_mb"]) - train[-1]["base_mem_mb"]  # during the training steps
            setup = train[-1]["setup_peak_mem_mb"] - train[-1]["base_mem_mb"]  # building and sharding (rank 0)
            state = max(train[-1]["state_mem_mb"])  # live tensors after backward: the model state
            ideal = 16 * params / world / 2**20
            rows.append({"strategy": s, "world": world, "state_mb": state, "state_vs_ideal": state / ideal,
                         "peak_mb": peak, "vs_ideal": peak / ideal, "setup_peak_mb": setup,
                         "ideal_state_mb": ideal})
    return {"model": model, "params": params, "img_size": img_size, "rows": rows}


# -- distillation: the teacher's cost -------------------------------------------------------------------------
def bench_distill(batch: int, steps: int, rounds: int, device: str) -> dict:
    """Student step images/s with and without a RegNetY-16GF teacher forward (no grad), same inputs."""
    best: dict[str, float] = {}
    for _ in range(rounds):
        for teacher in (None, "regnety_160"):
            r = _run_worker("distill", {"batch": batch, "steps": steps, "device": device, "teacher": teacher})
            key = teacher or "student_only"
            best[key] = max(best.get(key, 0.0), r["images_per_s"])
    return {"batch": batch, "results": best, "ratio_with_teacher": best["regnety_160"] / best["student_only"]}


def _distill_worker(spec: dict) -> dict:
    import timm

    from .models import create_model

    device = torch.device(spec["device"])
    torch.manual_seed(0)
    student = create_model("convit_small_plus", drop_path_rate=0.0).to(device).train()
    teacher = timm.create_model(spec["teacher"]).to(device).eval() if spec["teacher"] else None
    x = torch.randn(spec["batch"], 3, 224, 224, device=device)
    y = torch.randint(0, 1000, (spec["batch"],), device=device)

    def step():
        logits = student(x)
        loss = torch.nn.functional.cross_entropy(logits, y)
        if teacher is not None:  # DeiT's hard distillation: the teacher's argmax on the same batch
            with torch.no_grad():
                t = teacher(x).argmax(1)
            loss = 0.5 * loss + 0.5 * torch.nn.functional.cross_entropy(logits, t)
        loss.backward()

    step()
    return {"images_per_s": spec["batch"] * spec["steps"] / _timed(step, spec["steps"], device)}


def _cmd_bench(args) -> int:
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if args.what == "model":
        res = bench_model(args.batch or 8, args.steps, args.rounds, args.device, args.precision)
    elif args.what == "data":
        res = bench_data(out / "data_work", args.seconds, args.rounds)
    elif args.what == "memory":
        res = bench_memory(out / "memory_work", args.model, args.img_size, [int(w) for w in args.worlds.split(",")],
                           args.strategies.split(","))
    elif args.what == "mfu":
        res = bench_mfu(args.models.split(","), args.batch or 64, args.steps, args.warmup, args.device, args.precision,
                        args.peak_tflops, args.compile)
    else:
        res = bench_distill(args.batch or 4, args.steps, args.rounds, args.device)
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


def _worker_main() -> None:
    kind, spec = sys.argv[1], json.loads(sys.argv[2])
    fn = {"model": _model_worker, "data": _data_worker, "distill": _distill_worker, "train": _train_worker}[kind]
    print(json.dumps(fn(spec)))


if __name__ == "__main__":
    _worker_main()
