"""The Slurm scripts of slurm/ as data: each job script's ``#SBATCH`` options and the recipe it runs
(``RECIPE=${RECIPE:-...}``). The one reader of them, for ``convit-scale plan --slurm-jobs`` and the rehearsal."""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from pathlib import Path

_OPTION = re.compile(r"^#SBATCH\s+--([\w-]+)(?:[= ](\S+))?", re.MULTILINE)
_RECIPE = re.compile(r"RECIPE=\$\{RECIPE:-([^}]+)\}")
_PLANNED = re.compile(r"^# Time limit: (\d+) x the ([\d.]+) h that `convit-scale plan", re.MULTILINE)

TIME_MARGIN = 4
"""A job script's ``--time`` is this many times its job's wall-clock hours in ``convit-scale plan --slurm-jobs --gpu
h200-141gb``, rounded up to whole hours (the plan assumes 40% MFU and counts no evaluation, checkpoint or start-up;
a job that reaches its limit saves and requeues itself, so the limit trades the queue's wait against requeues)."""


def time_limit_hours(planned_hours: float) -> int:
    """The ``--time`` in hours for a job the planner gives ``planned_hours``."""
    return math.ceil(round(TIME_MARGIN * planned_hours, 6))


def slurm_folder() -> Path:
    """The checkout's slurm/ folder (beside the package), else ./slurm."""
    folder = Path(__file__).resolve().parents[1] / "slurm"
    return folder if folder.is_dir() else Path("slurm")


@dataclass(frozen=True)
class SlurmScript:
    """One script: its path, the recipe it runs by default (None: it takes any, as slurm/train.sh) and its
    ``#SBATCH --key=value`` options (a flag without a value maps to "")."""

    path: Path
    recipe: str | None
    options: dict
    text: str = ""

    def number(self, option: str, default: int) -> int:
        value = self.options.get(option, "")
        return int(value) if value.isdigit() else default

    @property
    def nodes(self) -> int:
        return self.number("nodes", 1)

    @property
    def tasks_per_node(self) -> int:
        return self.number("ntasks-per-node", 1)

    @property
    def gpus_per_node(self) -> int:
        return self.number("gpus-per-node", self.tasks_per_node)

    @property
    def cpus_per_task(self) -> int:
        return self.number("cpus-per-task", 1)

    @property
    def hours(self) -> float | None:
        """``--time`` in hours, in any of sbatch's forms (M, M:S, H:M:S, D-H, D-H:M, D-H:M:S); None without one."""
        days, _, clock = self.options.get("time", "").rpartition("-")
        if not re.fullmatch(r"\d+(:\d+){0,2}", clock) or not re.fullmatch(r"\d*", days):
            return None
        parts = [int(p) for p in clock.split(":")]
        if not days and len(parts) < 3:  # M or M:S
            parts = [0, *parts]
        h, m, sec = (parts + [0, 0])[:3]
        return int(days or 0) * 24 + h + m / 60 + sec / 3600

    @property
    def planned(self) -> tuple[int, float] | None:
        """(margin, planned hours) that the script's comment gives for its ``--time``, None without one."""
        found = _PLANNED.search(self.text)
        return (int(found.group(1)), float(found.group(2))) if found else None


def read_script(path: str | Path) -> SlurmScript:
    """The options and recipe of one script (FileNotFoundError when it is not a file)."""
    path = Path(path)
    text = path.read_text()
    recipe = _RECIPE.search(text)
    return SlurmScript(path, recipe.group(1) if recipe else None,
                       {key: value or "" for key, value in _OPTION.findall(text)}, text)


def job_scripts(folder: Path | None = None) -> list[SlurmScript]:
    """The scripts of ``folder`` (default :func:`slurm_folder`) that run a recipe of their own, by name."""
    scripts = [read_script(p) for p in sorted((folder or slurm_folder()).glob("*.sh"))]
    return [s for s in scripts if s.recipe is not None]
