"""The ``convit-scale`` command: config, models, prep, train, eval, export, analyze, bench, demo, experiment,
plan. One module per command registers its arguments and its handler.

Bad input has one contract for every command: a refused value or an expected failure (a recipe key, missing
data, a checkpoint that does not match, a number out of range), raised as ``errors.BadInput`` where the input is
checked, prints one line ``error: <message>`` on stderr and exits with status 2, checked before any work starts.
Every other exception is a bug and shows its traceback.
"""

from __future__ import annotations

import argparse
import difflib
import re
import sys

from .. import __version__, entry
from ..errors import BadInput
from ..runfolder import EXIT_BAD_INPUT
from . import analyze, bench, config, evaluate, experiment, export, models, plan, prep, train
from .models import model_table_rows

COMMANDS = (config, models, prep, train, evaluate, export, analyze, bench, experiment, plan)
"""Each module's ``register(sub)`` adds its sub-command(s), in the order of ``convit-scale --help``."""


class UsageError(BadInput):
    """A command line argparse refuses (unknown flag, value out of range)."""


class _HelpFormatter(argparse.HelpFormatter):
    """Every option's default in its help, as ``(default: X)``, unless the help already says what the default is
    or there is none (None, a switch that is off)."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        default = action.default
        # identity, not equality: a default of 0 (prep wds --seed) is shown; 0 == False
        if (default is None or default is argparse.SUPPRESS or "default" in text or isinstance(default, bool)
                or action.nargs in ("*", "+") and default == []):
            return text
        shown = ",".join(map(str, default)) if isinstance(default, (list, tuple)) else "%(default)s"
        return f"{text} (default: {shown})"


_OVERRIDE_AS_FLAG = re.compile(r"^--?([A-Za-z_]\w*(?:\.[A-Za-z_]\w*)+)(=(.*))?$")


def _override_hint(message: str) -> str:
    """For ``unrecognized arguments: --optim.base_lr=1e-3``: how the override is written."""
    if not message.startswith("unrecognized arguments:"):
        return ""
    for arg in message.partition(":")[2].split():
        m = _OVERRIDE_AS_FLAG.match(arg)
        if m:
            return f"; overrides are written without dashes: {m.group(1)}={m.group(3) if m.group(2) else 'VALUE'}"
    return ""


class _Parser(argparse.ArgumentParser):
    # argparse prints the usage and exits; here a refused argument is one `error:` line like every other
    # expected failure (sub-command parsers are made with the parent's class, so this covers them too).
    def __init__(self, *args, formatter_class=_HelpFormatter, **kwargs):
        super().__init__(*args, formatter_class=formatter_class, **kwargs)

    def error(self, message: str):
        raise UsageError(f"{self.prog}: {message}{_override_hint(message)}{self._choices_hint(message)}"
                         f"{self._typo_hint(message)}")

    def _option_strings(self) -> set[str]:
        """Every option of this parser and of its sub-commands' parsers (argparse reports an unknown option from
        the top parser, which does not know the sub-command it was meant for)."""
        found = {o for action in self._actions for o in action.option_strings}
        for action in self._actions:
            if isinstance(action, argparse._SubParsersAction):
                for sub in action.choices.values():
                    found |= sub._option_strings()
        return found

    def _typo_hint(self, message: str) -> str:
        """``--max-resolutoin``: did you mean ``--max-resolution``."""
        if not message.startswith("unrecognized arguments:"):
            return ""
        known = sorted(self._option_strings())
        for arg in message.partition(":")[2].split():
            name = arg.partition("=")[0]
            if not name.startswith("--") or "." in name:  # a dotted override written as a flag has its own hint
                continue
            close = difflib.get_close_matches(name, known, n=1)
            if close:
                return f"; did you mean {close[0]}?"
        return ""

    def _choices_hint(self, message: str) -> str:
        """A missing sub-command (or positional with choices) names the ones there are (argparse says only that one
        is required)."""
        if not message.startswith("the following arguments are required:"):
            return ""
        missing = message.partition(":")[2].replace(",", " ").split()
        for action in self._actions:
            if (action.dest in missing or action.metavar in missing) and action.choices:
                return f"; allowed: {', '.join(action.choices)} (`{self.prog} --help` says what each does)"
        return ""


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="convit-scale", description="Train and analyse ConViT and DeiT on ImageNet at cluster scale. "
                     "Bad input is one `error:` line and exit status 2, before any work starts.")
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    for command in COMMANDS:
        command.register(sub)
    return parser


def expected_errors() -> tuple[type[BaseException], ...]:
    """Failures that bad input causes: reported as one line, never as a traceback. ``BadInput`` is raised where input
    is checked (``errors.py``: recipes, data, weights, flags); a path the user named that is missing is one too. Any
    other exception, a ``ValueError`` included, is a bug and shows its traceback."""
    return (BadInput, FileNotFoundError)


def _one_line(e: BaseException) -> str:
    return " ".join(line.strip() for line in str(e).splitlines() if line.strip()) or type(e).__name__


def main(argv: list[str] | None = None) -> int:
    """The command line's exit status; as the process's entry point (no ``argv``: the ``convit-scale`` script,
    ``python -m convit_scale.cli``) without a last collection at exit over what torch and timm made (entry.py)."""
    code = _run(argv)
    return entry.exiting(code) if argv is None else code


def _run(argv: list[str] | None) -> int:
    try:
        args = build_parser().parse_args(argv)
        return int(args.func(args) or 0)
    except Exception as e:
        if not isinstance(e, expected_errors()):
            raise
        print(f"error: {_one_line(e)}", file=sys.stderr)
        return EXIT_BAD_INPUT


__all__ = ["main", "build_parser", "model_table_rows", "COMMANDS", "EXIT_BAD_INPUT"]
