"""A small replication of Table 2 anyone can run: ConViT vs DeiT of the same size on subsets of the
embedded Fashion-MNIST, epochs x 1/f, the same recipe otherwise (recipes/cpu/sample_efficiency.yaml)."""

from __future__ import annotations

import json
import math
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from data_prep import PrepOptions, prepare
from data_prep.fashion_mnist import build_tree

from ..analysis.plots import sample_efficiency
from ..config import load_config, recipe_path
from ..hardware import usable_cpus
from ..metrics import read_records
from ..train.launch import run_recipe


def run_sample_efficiency(out: Path, fractions: list[float], base_epochs: float, models: list[str],
                          nproc: int = 1, train_per_class: int = 1000, val_per_class: int = 200,
                          jobs: int = 1, seeds: tuple[int, ...] = (0,)) -> dict:
    """Train every (model, f, seed) run, ``jobs`` runs at a time (each in its own processes, the cores split evenly
    between them: small models use one core far better than two); a finished run is not trained again."""

    recipe = recipe_path("cpu/sample_efficiency.yaml")
    out = out.resolve()
    epochs_at = {f: max(1, round(base_epochs / f)) for f in fractions}  # Table 2: epochs x 1/f
    runs = _plan(out, recipe, fractions, epochs_at, models, seeds, train_per_class, val_per_class)
    threads = max(1, usable_cpus() // (jobs * nproc))

    def train(model: str, f: float, seed: int, run: Path, cfg) -> float:
        if not _ends(run):
            if jobs == 1:
                rc = run_recipe(cfg, nproc, in_process=True)
            else:
                rc = run_recipe(cfg, nproc, env={"OMP_NUM_THREADS": str(threads)}, quiet=True)
            if rc != 0:
                raise SystemExit(f"error: training {run} exited with status {rc} (its metrics.jsonl has the steps "
                                 f"it made; run the command again to resume it)")
        top1 = _ends(run)[-1]["top1"]
        print(f"{model} at f = {f:g}, seed {seed}: top-1 {top1:.2f}", flush=True)
        return top1

    if jobs == 1:  # in this thread: a run in this process sets its stop signals' handlers, which only it may
        results = [train(*r) for r in runs]
    else:
        with ThreadPoolExecutor(max_workers=jobs) as pool:
            results = list(pool.map(lambda r: train(*r), runs))
    batch = load_config(recipe).data.global_batch_size
    result = _summary(runs, results, fractions, epochs_at, models, batch, val_per_class * 10)
    result.update(base_epochs=base_epochs, train_images=train_per_class * 10, seeds=list(seeds))
    (out / "sample_efficiency.json").write_text(json.dumps(result, indent=1))

    sample_efficiency(result["table"], out / "sample_efficiency.png")
    return result


def _plan(out: Path, recipe, fractions, epochs_at, models, seeds, train_per_class, val_per_class) -> list[tuple]:
    """(model, f, seed, run folder, config) of every run, each one's options checked before the first starts.
    Seed 0 keeps the folder name of a one-seed run (``convit_micro_f0.1``), so that earlier runs are reused."""

    tree = build_tree(out / "data" / "tree", {"train": train_per_class, "val": val_per_class})
    runs = []
    for f in fractions:
        data = out / "data" / f"wds_f{f:g}"  # Table 2 subsets: the first floor(n_c * f) files per class
        prepare(tree, data, PrepOptions(fmt="wds", subset_fraction=f, shard_size=500, workers=2))
        for seed in seeds:
            for model in models:
                run = out / (f"{model}_f{f:g}" + (f"_s{seed}" if seed else ""))
                epochs = epochs_at[f]
                overrides = [f"model.name={model}", f"data.train_path={data}", f"data.val_path={data}",
                             f"data.subset_fraction={f}", f"schedule.epochs={epochs}", f"run.output_dir={run}",
                             f"run.seed={seed}", f"run.eval_every_epochs={max(1, epochs // 10)}"]  # ~10 points
                runs.append((model, f, seed, run, load_config(recipe, overrides)))
    return runs


def _summary(runs, results, fractions, epochs_at, models, batch: int, val_images: int) -> dict:
    """The table (each model's final top-1 at each f, the mean over seeds), every seed's, the images each run
    trained on (its steps x the global batch: the last partial batch of an epoch is dropped), and the gap of the
    first model over the second with its noise: the standard error of that difference from the validation sample
    alone (sqrt(p(1-p)/n) per model, added in quadrature; the same images make the true one smaller) and, with
    two seeds or more, the spread of the gap between seeds."""
    per_seed: dict[str, dict[str, list[float]]] = {m: {} for m in models}
    images: dict[str, int] = {}
    for (model, f, _, run, _), top1 in zip(runs, results):
        per_seed[model].setdefault(f"{f:g}", []).append(top1)
        images[f"{f:g}"] = _ends(run)[-1]["step"] * batch
    table = {m: {f: sum(v) / len(v) for f, v in by_f.items()} for m, by_f in per_seed.items()}
    gaps = {}
    if len(models) == 2:
        a, b = models
        for f in (f"{x:g}" for x in fractions):
            se = [math.sqrt(p / 100 * (1 - p / 100) / val_images) * 100 for p in (table[a][f], table[b][f])]
            seed_gaps = [x - y for x, y in zip(per_seed[a][f], per_seed[b][f])]
            gaps[f] = {"gap": table[a][f] - table[b][f], "sampling_se": math.hypot(*se), "per_seed": seed_gaps}
    lines = ["| f | epochs | images trained on | " + " | ".join(models) + (" | gap | +-2 s.e. (sample) | gap per seed |"
                                                                      if gaps else " |"),
             "|---|---|---|" + "---|" * (len(models) + (3 if gaps else 0))]
    for f in fractions:
        k = f"{f:g}"
        row = f"| {k} | {epochs_at[f]} | {images[k]:,} | " + " | ".join(f"{table[m][k]:.2f}" for m in models)
        if gaps:
            g = gaps[k]
            row += f" | {g['gap']:+.2f} | {2 * g['sampling_se']:.2f} | " + ", ".join(f"{x:+.2f}" for x in g["per_seed"])
        lines.append(row + " |")
    return {"table": table, "per_seed": per_seed, "gaps": gaps, "images_trained_on": images,
            "markdown": "\n".join(lines), "val_images": val_images}


def _ends(run: Path) -> list[dict]:
    return [r for r in read_records(run, "end") if "top1" in r]
