"""``convit-scale demo`` and ``convit-scale experiment``: the runs of convit_scale/experiments/."""

from __future__ import annotations

import argparse
from pathlib import Path

from ..errors import BadInput
from .argtypes import fractions, names, non_negative_int, positive_float, positive_int


def _cmd_demo(args) -> int:
    import torch

    from ..experiments.demo import run_demo

    nproc = args.nproc or (torch.cuda.device_count() if torch.cuda.is_available() else 2)
    run_demo(Path(args.out), loader=args.loader, strategy=args.strategy, nproc=nproc, epochs=args.epochs,
             train_per_class=args.train_per_class, val_per_class=args.val_per_class, extra=args.overrides)
    return 0


def _cmd_experiment(args) -> int:
    from ..experiments.sample_efficiency import run_sample_efficiency
    from ..models import MODELS

    unknown = [m for m in args.models if m not in MODELS]
    if unknown:
        raise BadInput(f"--models: unknown model(s) {', '.join(unknown)}; allowed: {', '.join(MODELS)}")
    table = run_sample_efficiency(Path(args.out), fractions=args.fractions, base_epochs=args.base_epochs,
                                  models=args.models, nproc=args.nproc, train_per_class=args.train_per_class,
                                  val_per_class=args.val_per_class, jobs=args.jobs, seeds=tuple(args.seeds))
    print(table["markdown"])
    return 0


def _seeds(text: str) -> list[int]:
    """--seeds: comma-separated distinct integers >= 0."""
    seeds = [non_negative_int(part) for part in names(text)]
    if len(set(seeds)) != len(seeds):
        raise argparse.ArgumentTypeError(f"{text!r}: a seed given twice")
    return seeds


def register(sub) -> None:
    p = sub.add_parser("demo", help="the whole pipeline on the embedded Fashion-MNIST (what `make demo` runs)")
    p.add_argument("--out", default="runs/demo", help="folder for data, run, checkpoints and plots")
    p.add_argument("--loader", default="wds", choices=["wds", "ffcv", "imagefolder"], help="data loader")
    p.add_argument("--strategy", default="fsdp2", choices=["fsdp2", "ddp", "zero1", "zero2", "zero3"],
                   help="parallel.strategy of the training run")
    p.add_argument("--nproc-per-node", "--nproc", dest="nproc", type=positive_int, default=None,
                   help="training processes (default: every GPU where present, else 2 CPU processes)")
    p.add_argument("--epochs", type=positive_int, help="override the demo recipe's epochs")
    p.add_argument("--train-per-class", type=positive_int, default=6000,
                   help="Fashion-MNIST train images per class (6000: all of them)")
    p.add_argument("--val-per-class", type=positive_int, default=200, help="Fashion-MNIST val images per class")
    p.add_argument("overrides", nargs="*", help="recipe overrides, e.g. schedule.epochs=2")
    p.set_defaults(func=_cmd_demo)

    p = sub.add_parser("experiment", help="small replications anyone can run on CPU")
    p.add_argument("which", choices=["sample-efficiency"],
                   help="sample-efficiency: Table 2 at small size (DeiT vs ConViT on subsets of Fashion-MNIST)")
    p.add_argument("--out", default="runs/sample_efficiency", help="folder for the runs, the table and the plot")
    p.add_argument("--fractions", type=fractions, default=[0.05, 0.1, 0.3, 0.5, 1.0],
                   help="comma-separated subset fractions, each in (0, 1] (default: Table 2's 0.05,0.1,0.3,0.5,1)")
    p.add_argument("--seeds", type=_seeds, default=[0],
                   help="comma-separated seeds, a run of each (model, f) per seed (default 0)")
    p.add_argument("--models", type=names, default=["convit_micro", "deit_micro"],
                   help="comma-separated models (default convit_micro,deit_micro)")
    p.add_argument("--base-epochs", type=positive_float, default=12,
                   help="epochs at f = 1 (each f trains base/f epochs)")
    p.add_argument("--train-per-class", type=positive_int, default=1000, help="Fashion-MNIST train images per class")
    p.add_argument("--val-per-class", type=positive_int, default=200, help="Fashion-MNIST val images per class")
    p.add_argument("--nproc-per-node", "--nproc", dest="nproc", type=positive_int, default=1,
                   help="processes per training run")
    p.add_argument("--jobs", type=positive_int, default=1,
                   help="training runs at a time, the cores split between them (2 on 2 cores: one run per core)")
    p.set_defaults(func=_cmd_experiment)
