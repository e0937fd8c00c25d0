"""`convit-scale demo` (what `make demo` runs): the whole product on the embedded real dataset.

1. Fashion-MNIST (Debian's dataset-fashion-mnist) -> ImageNet-style tree -> WebDataset shards and an
   FFCV .beton, with the real converters;
2. a CPU-sized ConViT trained with FSDP2 on 2 processes (gloo on CPU; NCCL and every GPU where present),
   evaluating every epoch, checkpointing, resuming if run again;
3. a summary table and the analysis plots of the trained model.
A second run does not redo finished work: conversions are skipped and a finished training is not rerun.
"""

from __future__ import annotations

import time
from pathlib import Path

from .metrics import read_records

REPO_RECIPES = Path(__file__).resolve().parents[1] / "recipes"


def _finished(run_dir: Path) -> dict | None:
    ends = read_records(run_dir, "end")
    return ends[-1] if ends and Path(ends[-1]["checkpoint"]).is_dir() else None


def _summary_table(run_dir: Path, out: Path, end: dict, plots: list[str], seconds: dict):
    from rich.table import Table

    train = read_records(run_dir, "train")
    evals = read_records(run_dir, "eval")
    ips = [r["images_per_s"] for r in train[len(train) // 4:]] or [0.0]
    table = Table(title="convit-scale demo")
    table.add_column("what")
    table.add_column("value")
    import yaml

    cfg = yaml.safe_load((run_dir / "config.yaml").read_text())
    table.add_row("model / data", f"{cfg['model']['name']} on Fashion-MNIST (32x32), {cfg['parallel']['strategy']}, "
                                  f"{cfg['data']['format']} loader, {len(train[-1]['peak_mem_mb'])} process(es)")
    table.add_row("top-1 / top-5 (val)", f"{evals[-1]['top1']:.2f} / {evals[-1]['top5']:.2f}  ({evals[-1]['samples']} images)")
    table.add_row("top-1 per epoch", " ".join(f"{e['top1']:.1f}" for e in evals))
    table.add_row("training images/s", f"{sorted(ips)[len(ips) // 2]:.0f} (median)")
    table.add_row("peak memory per rank (MB)", ", ".join(f"{m:.0f}" for m in train[-1]["peak_mem_mb"]))
    table.add_row("steps", str(end["step"]))
    table.add_row("time (s)", ", ".join(f"{k} {v:.0f}" for k, v in seconds.items()))
    table.add_row("run folder", str(run_dir))
    table.add_row("checkpoint", end["checkpoint"])
    table.add_row("analysis plots", str(out / "analysis") + " (" + ", ".join(Path(p).name for p in plots) + ")")
    return table


def run_demo(out: Path, loader: str = "wds", strategy: str = "fsdp2", nproc: int = 2, epochs: int | None = None,
             train_per_class: int = 1000, val_per_class: int = 200, extra: list[str] | None = None) -> dict:
    from rich.console import Console

    from data_prep import PrepOptions, prepare
    from data_prep.fashion_mnist import build_tree

    from .analysis.cli import eval_batches
    from .analysis.report import analyze
    from .config import load_config
    from .train.launch import run_recipe
    from .train.export import load_trained_model

    console = Console()
    out = out.resolve()
    seconds: dict[str, float] = {}
    t0 = time.time()
    run_dir = out / "train"
    prepared = {"wds": out / "data" / "wds", "ffcv": out / "data" / "ffcv", "imagefolder": out / "data" / "tree"}
    overrides = [f"data.format={loader}", f"data.train_path={prepared[loader]}", f"data.val_path={prepared[loader]}",
                 f"parallel.strategy={strategy}", f"run.output_dir={run_dir}", *(extra or [])]
    if epochs is not None:
        overrides.append(f"schedule.epochs={epochs}")
    recipe = str(REPO_RECIPES / "cpu" / "demo.yaml")
    load_config(recipe, overrides)  # refuse a bad option before any work starts

    console.rule("1/3 data: Fashion-MNIST -> ImageFolder tree -> WebDataset shards and FFCV")
    tree = build_tree(prepared["imagefolder"], {"train": train_per_class, "val": val_per_class})
    for fmt in ("wds", "ffcv"):
        prepare(tree, prepared[fmt], PrepOptions(fmt=fmt, shard_size=500, workers=2))
    seconds["data"] = time.time() - t0

    console.rule(f"2/3 train: the demo recipe (recipes/cpu/demo.yaml), {strategy}, {nproc} process(es), {loader} loader")
    t1 = time.time()
    end = _finished(run_dir)
    if end is not None:
        console.print(f"already trained ({end['step']} steps): {end['checkpoint']}; delete {run_dir} to retrain")
    else:
        rc = run_recipe(recipe, overrides, nproc, in_process=True)
        if rc != 0:
            raise SystemExit(f"error: training exited with status {rc}; run `make demo` again to resume")
        end = _finished(run_dir)
    seconds["train"] = time.time() - t1

    console.rule("3/3 analysis: gating, nonlocality, attention maps, attention distance, CKA")
    t2 = time.time()
    model = load_trained_model(end["checkpoint"])
    batches = eval_batches(str(prepared[loader]), loader, model.patch_embed.img_size[0], 4)
    result = analyze(model, batches, out / "analysis", run_dir=run_dir, names=("convit_micro", ""))
    seconds["analysis"] = time.time() - t2
    console.print(_summary_table(run_dir, out, end, result["files"], seconds))
    return {"end": end, "analysis": result, "run_dir": str(run_dir)}


def _cmd_demo(args) -> int:
    import torch

    nproc = args.nproc or (torch.cuda.device_count() if torch.cuda.is_available() else 2)
    run_demo(Path(args.out), loader=args.loader, strategy=args.strategy, nproc=nproc, epochs=args.epochs,
             train_per_class=args.train_per_class, val_per_class=args.val_per_class, extra=args.overrides)
    return 0


def add_subcommand(sub) -> None:
    p = sub.add_parser("demo", help="the whole pipeline on the embedded Fashion-MNIST (what `make demo` runs)")
    p.add_argument("--out", default="runs/demo", help="folder for data, run, checkpoints and plots")
    p.add_argument("--loader", default="wds", choices=["wds", "ffcv", "imagefolder"], help="data loader")
    p.add_argument("--strategy", default="fsdp2", choices=["fsdp2", "ddp", "zero1", "zero2", "zero3"])
    p.add_argument("--nproc", type=int, default=None,
                   help="training processes (default: every GPU where present, else 2 CPU processes)")
    p.add_argument("--epochs", type=int, help="override the demo recipe's epochs")
    p.add_argument("--train-per-class", type=int, default=1000, help="Fashion-MNIST train images per class")
    p.add_argument("--val-per-class", type=int, default=200, help="Fashion-MNIST val images per class")
    p.add_argument("overrides", nargs="*", help="recipe overrides, e.g. schedule.epochs=2")
    p.set_defaults(func=_cmd_demo)

