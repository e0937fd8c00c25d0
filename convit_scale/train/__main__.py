"""``python -m convit_scale.train``: one rank, as torchrun, srun or ``accelerate launch`` start it.

Two ways in: ``--recipe R [overrides]`` (each rank validates the recipe; rank 0 runs the preflight before the
process group forms, the others wait for it at the rendezvous), or ``--config RUN/config.yaml``, the resolved
config that a launching process (``convit-scale train --nproc-per-node``, ``launch.run_recipe``) wrote after its
own preflight.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

from .. import entry
from .signals import catch_early

if __name__ == "__main__":
    catch_early()  # Slurm's USR1 during the imports and the preflight is kept, not fatal (signals.py)
    entry.importing()  # a rank's start: no collections while torch and timm import (entry.py)

from ..config import ConfigError, find_recipe, load_config
from ..errors import BadInput
from ..runfolder import FolderHeld
from .distributed import check_launcher_env
from .engine import EXIT_BAD_INPUT, exit_status
from .preflight import preflight


def _launch_rank() -> int:
    """This process's rank as the launcher set it, before any process group exists."""
    return int(os.environ.get("RANK", os.environ.get("SLURM_PROCID", "0")))


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m convit_scale.train")
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--recipe", help="a recipe file or a shipped recipe's name")
    source.add_argument("--config", help="a resolved config.yaml written by a launching process (no overrides)")
    parser.add_argument("--resume", default=None, metavar="auto|none|PATH",
                        help="the same as the override checkpoint.resume=..., which this flag wins over")
    parser.add_argument("overrides", nargs="*", help="dotted overrides, e.g. parallel.strategy=zero3")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    overrides = list(args.overrides) + ([f"checkpoint.resume={json.dumps(args.resume)}"] if args.resume else [])
    try:
        if args.config:
            if args.overrides:
                raise ConfigError(f"--config {args.config} is a resolved config: no overrides ({args.overrides[0]})")
            cfg = load_config(args.config, overrides)
        else:
            cfg = load_config(find_recipe(args.recipe), overrides)
        check_launcher_env(cfg.parallel.strategy, cfg.parallel.precision)
        if not args.config and _launch_rank() == 0:  # the other ranks wait at the rendezvous and stop with it
            preflight(cfg)
    except (BadInput, FolderHeld, FileNotFoundError) as e:  # anything else is a bug: a traceback, a crash restarted
        print(f"error: {e}", file=sys.stderr)
        return EXIT_BAD_INPUT
    return exit_status(cfg)


if __name__ == "__main__":
    entry.imported()
    sys.exit(entry.exiting(main()))
