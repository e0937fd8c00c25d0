"""`convit-scale demo` (what `make demo` runs): the whole product on the embedded real dataset.

1. Fashion-MNIST (Debian's dataset-fashion-mnist) -> ImageNet-style tree -> WebDataset shards and an
   FFCV .beton, with the real converters;
2. a CPU-sized ConViT trained with FSDP2 on 2 processes (gloo on CPU; NCCL and every GPU where present),
   evaluating every epoch, checkpointing, resuming if run again;
3. a summary table and the analysis plots of the trained model.
A second run does not redo finished work: conversions are skipped and a finished training is not rerun.
"""

from __future__ import annotations

import contextlib
import functools
import time
from pathlib import Path

import yaml
from rich.table import Table

from data_prep import PrepOptions, prepare
from data_prep.fashion_mnist import build_tree

from ..analysis.report import ANALYSIS_IMAGES, analyze, eval_batches
from ..config import load_config, recipe_path
from ..console import console as make_console
from ..evaluation import resolve_device
from ..ffcv_threads import importing_ffcv
from ..metrics import read_records
from ..train.launch import run_recipe
from ..trained import eval_view, load_trained_model


def _finished(run_dir: Path) -> dict | None:
    ends = read_records(run_dir, "end")
    return ends[-1] if ends and Path(ends[-1]["checkpoint"]).is_dir() else None


def _summary_table(run_dir: Path, out: Path, end: dict, plots: list[str], seconds: dict):
    train = read_records(run_dir, "train")
    evals = read_records(run_dir, "eval")
    ips = [r["images_per_s"] for r in train[len(train) // 4:]] or [0.0]
    table = Table(title="convit-scale demo")
    table.add_column("what")
    table.add_column("value")

    cfg = yaml.safe_load((run_dir / "config.yaml").read_text())
    size = cfg["model"].get("img_size") or 32
    patch = cfg["model"].get("patch_size")
    table.add_row("model / data", f"{cfg['model']['name']} on Fashion-MNIST ({size}x{size}"
                                  f"{f', {patch}x{patch} patches' if patch else ''}), {cfg['parallel']['strategy']}, "
                                  f"{cfg['data']['format']} loader, {len(train[-1]['peak_mem_mb'])} process(es)")
    table.add_row("top-1 / top-5 (val)",
                  f"{evals[-1]['top1']:.2f} / {evals[-1]['top5']:.2f}  ({evals[-1]['samples']} images)")
    if "best_top1" in evals[-1]:
        table.add_row("best top-1 (epoch)", f"{evals[-1]['best_top1']:.2f} ({evals[-1]['best_epoch']})")
    table.add_row("top-1 per epoch", " ".join(f"{e['top1']:.1f}" for e in evals))
    table.add_row("training images/s", f"{sorted(ips)[len(ips) // 2]:.0f} (median)")
    table.add_row("peak memory per rank (MB)", ", ".join(f"{m:.0f}" for m in train[-1]["peak_mem_mb"]))
    table.add_row("steps", str(end["step"]))
    table.add_row("time (s)", ", ".join(f"{k} {v:.0f}" for k, v in seconds.items()))
    table.add_row("run folder", str(run_dir))
    table.add_row("checkpoint", end["checkpoint"])
    table.add_row("analysis plots", str(out / "analysis") + " (" + ", ".join(Path(p).name for p in plots) + ")")
    return table


@contextlib.contextmanager
def _quiet_tqdm():
    """FFCV's writer draws a tqdm bar of its own (``ffcv.writer.tqdm``); tqdm reads TQDM_DISABLE only when it is
    first imported, which may already have happened, so the writer's name is bound to a disabled bar instead."""

    with importing_ffcv():
        import ffcv.writer

    bar = ffcv.writer.tqdm
    ffcv.writer.tqdm = functools.partial(bar, disable=True)
    try:
        yield
    finally:
        ffcv.writer.tqdm = bar


def run_demo(out: Path, loader: str = "wds", strategy: str = "fsdp2", nproc: int = 2, epochs: int | None = None,
             train_per_class: int = 6000, val_per_class: int = 200, extra: list[str] | None = None) -> dict:
    """The demo's three steps into ``out`` (the module says what they are); the run's end record, the analysis and
    the run folder."""
    console = make_console()
    out = out.resolve()
    seconds: dict[str, float] = {}
    t0 = time.time()
    run_dir = out / "train"
    prepared = {"wds": out / "data" / "wds", "ffcv": out / "data" / "ffcv", "imagefolder": out / "data" / "tree"}
    overrides = [f"data.format={loader}", f"data.train_path={prepared[loader]}", f"data.val_path={prepared[loader]}",
                 f"parallel.strategy={strategy}", f"run.output_dir={run_dir}", *(extra or [])]
    if epochs is not None:
        overrides.append(f"schedule.epochs={epochs}")
    recipe = str(recipe_path("cpu/demo.yaml"))
    cfg = load_config(recipe, overrides)  # refuse a bad option before any work starts

    console.rule("1/3 data: Fashion-MNIST -> ImageFolder tree -> WebDataset shards and FFCV")
    tree = build_tree(prepared["imagefolder"], {"train": train_per_class, "val": val_per_class})
    for fmt in ("wds", "ffcv"):
        with _quiet_tqdm():  # FFCV's writer draws a tqdm bar of its own inside the demo's output
            prepare(tree, prepared[fmt], PrepOptions(fmt=fmt, shard_size=500, workers=2))
    seconds["data"] = time.time() - t0

    console.rule(f"2/3 train: the demo recipe (recipes/cpu/demo.yaml), {strategy}, {nproc} process(es), "
                 f"{loader} loader")
    t1 = time.time()
    end = _finished(run_dir)
    if end is not None:
        console.print(f"already trained ({end['step']} steps): {end['checkpoint']}; delete {run_dir} to retrain")
    else:
        rc = run_recipe(cfg, nproc, in_process=True)
        if rc != 0:
            raise SystemExit(f"error: training exited with status {rc}; run `make demo` again to resume")
        end = _finished(run_dir)
    seconds["train"] = time.time() - t1

    console.rule("3/3 analysis: gating, nonlocality, attention maps, attention distance, CKA")
    t2 = time.time()
    model = load_trained_model(end["checkpoint"]).to(resolve_device())
    batches = eval_batches(str(prepared[loader]), loader, model.patch_embed.img_size[0], ANALYSIS_IMAGES,
                           **eval_view(end["checkpoint"]))
    result = analyze(model, batches, out / "analysis", run_dir=run_dir, names=("convit_micro", ""))
    seconds["analysis"] = time.time() - t2
    console.print(_summary_table(run_dir, out, end, result["files"], seconds))
    return {"end": end, "analysis": result, "run_dir": str(run_dir)}
