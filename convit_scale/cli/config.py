"""``convit-scale config --recipe RECIPE [overrides]``: print the resolved config of a recipe (``config RECIPE
[overrides]``, the recipe first and without the flag, is accepted too)."""

from __future__ import annotations

import argparse

from .argtypes import recipe

RECIPE_HELP = "a recipe file or a shipped recipe's name (recipes/cpu/demo.yaml)"


def _cmd_config(args) -> int:
    from ..config import load_config

    path, overrides = args.recipe, list(args.rest)
    if path is None:  # the older form: the recipe is the first positional argument
        if not overrides or "=" in overrides[0]:
            raise ValueError(f"config needs --recipe; allowed: {RECIPE_HELP}, as --recipe R or as the first argument")
        try:
            path = recipe(overrides.pop(0))
        except argparse.ArgumentTypeError as e:
            raise ValueError(f"argument --recipe: {e}") from None
    print(load_config(path, overrides).to_yaml(), end="")
    return 0


def register(sub) -> None:
    p = sub.add_parser("config", help="print the resolved config of a recipe",
                       description="Print the resolved config of a recipe: its inheritance and the overrides applied, "
                                   "every key checked. `config RECIPE [overrides]` works too.")
    p.add_argument("--recipe", type=recipe, help=RECIPE_HELP)
    p.add_argument("rest", nargs="*", metavar="override",
                   help="dotted overrides, e.g. optim.base_lr=4e-4 (without --recipe: the recipe first)")
    p.set_defaults(func=_cmd_config)
