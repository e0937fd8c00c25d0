"""``convit-scale config RECIPE [overrides]``: print the resolved config of a recipe."""

from __future__ import annotations

from .argtypes import recipe


def _cmd_config(args) -> int:
    from ..config import load_config

    print(load_config(args.recipe, args.overrides).to_yaml(), end="")
    return 0


def register(sub) -> None:
    p = sub.add_parser("config", help="print the resolved config of a recipe")
    p.add_argument("recipe", type=recipe, help="a recipe file or a shipped recipe's name (recipes/cpu/demo.yaml)")
    p.add_argument("overrides", nargs="*", help="dotted overrides, e.g. optim.base_lr=4e-4")
    p.set_defaults(func=_cmd_config)
