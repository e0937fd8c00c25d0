"""``convit-scale config --recipe RECIPE [overrides]``: print the resolved config of a recipe (``config RECIPE
[overrides]``, the recipe first and without the flag, is accepted too), or one key of it (``--get``)."""

from __future__ import annotations

import argparse
import json
import sys

from ..errors import BadInput
from .argtypes import int_at_least, recipe

RECIPE_HELP = "a recipe file or a shipped recipe's name (recipes/cpu/demo.yaml)"


def _cmd_config(args) -> int:
    from ..config import explain, load_config, shares_note

    path, overrides = args.recipe, list(args.rest)
    if args.explain is not None and path is None and not overrides:  # a key's documentation, no recipe needed
        print(explain(args.explain), end="")
        return 0
    if path is None:  # the older form: the recipe is the first positional argument
        if not overrides or "=" in overrides[0]:
            raise BadInput(f"config needs --recipe; allowed: {RECIPE_HELP}, as --recipe R or as the first argument")
        try:
            path = recipe(overrides.pop(0))
        except argparse.ArgumentTypeError as e:
            raise BadInput(f"argument --recipe: {e}") from None
    cfg = load_config(path, overrides)
    if args.explain is not None:
        print(explain(args.explain, cfg), end="")
        return 0
    if args.world_size is not None:  # slurm/launch.sh: the job's ranks, before any of them starts
        from ..train.distributed import check_world

        check_world(cfg, args.world_size)  # what every rank checks again at set-up, and `plan` too
        note = shares_note(cfg.data.groups, args.world_size)
        if note:  # a YAML comment above the config (launch.sh prints it in the job's log)
            print(f"# {note}", file=sys.stdout if args.get is None else sys.stderr)
    if args.check_data is not None:
        _check_data(cfg, args.check_data)
    if args.get is None:
        print(cfg.to_yaml(), end="")
        return 0
    value = cfg.to_dict()
    for part in args.get.split("."):
        if not isinstance(value, dict) or part not in value:
            raise BadInput(f"--get {args.get}: no such key in the config; allowed: a dotted key such as "
                           f"run.output_dir or data.global_batch_size")
        value = value[part]
    print(value if not isinstance(value, (dict, list)) else json.dumps(value))
    return 0


def _check_data(cfg, where: str) -> None:
    """The data the recipe trains on, checked as training's preflight checks it (its manifest); a refusal names
    ``where`` the paths came from (slurm/launch.sh: DATA_DIR) and what the recipe's data.format reads."""
    from ..manifest import DataError
    from ..train.preflight import DATA_FORMS, check_data

    try:
        check_data(cfg)
    except DataError as e:
        fmt = cfg.data.format
        raise BadInput(f"{where}: {e}; expected {fmt} data (data.format): {DATA_FORMS[fmt]}") from None


def register(sub) -> None:
    p = sub.add_parser("config", help="print the resolved config of a recipe",
                       description="Print the resolved config of a recipe: its inheritance and the overrides applied, "
                                   "every key checked. `config RECIPE [overrides]` works too.")
    p.add_argument("--recipe", type=recipe, help=RECIPE_HELP)
    p.add_argument("--get", metavar="KEY", help="print only this dotted key's value (e.g. run.output_dir), for scripts")
    p.add_argument("--explain", metavar="KEY",
                   help="a dotted key's (or section's) documentation: type, default, what it does (with a recipe: "
                        "its value there too)")
    p.add_argument("--world-size", type=int_at_least(1), metavar="N",
                   help="refuse the recipe unless N ranks can run it (each rank whole canonical groups), for scripts")
    p.add_argument("--check-data", metavar="WHERE",
                   help="refuse the recipe unless its data (data.train_path, data.val_path) read as training reads "
                        "them (manifest.json); WHERE says where the paths came from, e.g. DATA_DIR=/data/x, for "
                        "scripts")
    p.add_argument("rest", nargs="*", metavar="override",
                   help="dotted overrides, e.g. optim.base_lr=4e-4 (without --recipe: the recipe first)")
    p.set_defaults(func=_cmd_config)
