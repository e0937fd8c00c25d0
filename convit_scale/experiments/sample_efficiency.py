"""A small replication of Table 2 anyone can run: ConViT vs DeiT of the same size on subsets of the
embedded Fashion-MNIST, epochs x 1/f, the same recipe otherwise (recipes/cpu/sample_efficiency.yaml)."""

from __future__ import annotations

import json
from pathlib import Path

from ..hardware import usable_cpus
from ..metrics import read_records

def run_sample_efficiency(out: Path, fractions: list[float], base_epochs: float, models: list[str],
                          nproc: int = 1, train_per_class: int = 1000, val_per_class: int = 200,
                          jobs: int = 1) -> dict:
    """Train every (model, f) pair, ``jobs`` runs at a time (each in its own processes, the cores split evenly
    between them: small models use one core far better than two); a finished run is not trained again."""
    from concurrent.futures import ThreadPoolExecutor

    from data_prep import PrepOptions, prepare
    from data_prep.fashion_mnist import build_tree

    from ..analysis.plots import sample_efficiency
    from ..config import load_config, recipe_path
    from ..train.launch import run_recipe

    recipe = recipe_path("cpu/sample_efficiency.yaml")

    out = out.resolve()
    tree = build_tree(out / "data" / "tree", {"train": train_per_class, "val": val_per_class})
    epochs_at = {f: max(1, round(base_epochs / f)) for f in fractions}  # Table 2: epochs x 1/f
    runs = []
    for f in fractions:
        data = out / "data" / f"wds_f{f:g}"  # Table 2 subsets: the first floor(n_c * f) files per class
        prepare(tree, data, PrepOptions(fmt="wds", subset_fraction=f, shard_size=500, workers=2))
        for model in models:
            run = out / f"{model}_f{f:g}"
            epochs = epochs_at[f]
            overrides = [f"model.name={model}", f"data.train_path={data}", f"data.val_path={data}",
                         f"data.subset_fraction={f}", f"schedule.epochs={epochs}", f"run.output_dir={run}",
                         f"run.eval_every_epochs={max(1, epochs // 10)}"]  # a curve of ~10 points per run
            cfg = load_config(recipe, overrides)  # every run's options are checked before the first one starts
            runs.append((model, f, run, cfg))
    threads = max(1, usable_cpus() // (jobs * nproc))

    def train(model: str, f: float, run: Path, cfg) -> float:
        if not _ends(run):
            if jobs == 1:
                rc = run_recipe(cfg, nproc, in_process=True)
            else:
                rc = run_recipe(cfg, nproc, env={"OMP_NUM_THREADS": str(threads)}, quiet=True)
            if rc != 0:
                raise SystemExit(f"error: training {run} exited with status {rc} (its metrics.jsonl has the steps "
                                 f"it made; run the command again to resume it)")
        top1 = _ends(run)[-1]["top1"]
        print(f"{model} at f = {f:g}: top-1 {top1:.2f}", flush=True)
        return top1

    with ThreadPoolExecutor(max_workers=jobs) as pool:
        results = list(pool.map(lambda r: train(*r), runs))
    table: dict[str, dict[str, float]] = {m: {} for m in models}
    for (model, f, _, _), top1 in zip(runs, results):
        table[model][f"{f:g}"] = top1
    lines = ["| f | epochs | " + " | ".join(models) + " |", "|---|---|" + "---|" * len(models)]
    for f in fractions:
        lines.append(f"| {f:g} | {epochs_at[f]} | "
                     + " | ".join(f"{table[m][f'{f:g}']:.2f}" for m in models) + " |")
    result = {"table": table, "markdown": "\n".join(lines), "base_epochs": base_epochs,
              "train_images": train_per_class * 10, "val_images": val_per_class * 10}
    (out / "sample_efficiency.json").write_text(json.dumps(result, indent=1))
    sample_efficiency(table, out / "sample_efficiency.png")
    return result


def _ends(run: Path) -> list[dict]:
    return [r for r in read_records(run, "end") if "top1" in r]
