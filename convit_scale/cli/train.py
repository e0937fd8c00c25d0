"""``convit-scale train``: a recipe alone, under torchrun/srun/accelerate, or on N local processes."""

from __future__ import annotations

import json

from .argtypes import positive_int, recipe, resume


def _cmd_train(args) -> int:
    from ..config import load_config
    from ..train.launch import run_recipe

    overrides = list(args.overrides)
    if args.resume is not None:  # the flag wins over an override of the same key
        overrides.append(f"checkpoint.resume={json.dumps(args.resume)}")
    cfg = load_config(args.recipe, overrides)  # refused here, before any process starts
    return run_recipe(cfg, args.nproc_per_node or 1, in_process=True)


def register(sub) -> None:
    p = sub.add_parser("train", help="train a recipe (alone, under torchrun, srun or accelerate launch)")
    p.add_argument("--recipe", required=True, type=recipe,
                   help="a recipe file or a shipped recipe's name (recipes/table1/convit_small.yaml)")
    p.add_argument("--nproc-per-node", type=positive_int, default=None,
                   help="start this many local ranks (>= 1) with torchrun (default: run as launched)")
    p.add_argument("--resume", type=resume, default=None, metavar="auto|none|PATH",
                   help="auto: the newest complete checkpoint of the run (the recipes' default); none: start afresh; "
                        "PATH: that checkpoint folder. The same as checkpoint.resume=...")
    p.add_argument("overrides", nargs="*", help="dotted overrides, e.g. parallel.strategy=zero3")
    p.set_defaults(func=_cmd_train)
