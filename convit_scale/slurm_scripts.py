"""The Slurm scripts of slurm/ as data: each job script's ``#SBATCH`` options and the recipe it runs
(``RECIPE=${RECIPE:-...}``). The one reader of them, for ``convit-scale plan --slurm-jobs`` and the rehearsal."""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

_OPTION = re.compile(r"^#SBATCH\s+--([\w-]+)(?:[= ](\S+))?", re.MULTILINE)
_RECIPE = re.compile(r"RECIPE=\$\{RECIPE:-([^}]+)\}")


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


def read_script(path: str | Path) -> SlurmScript:
    """The options and recipe of one script (FileNotFoundError when it is not a file)."""
    path = Path(path)
    text = path.read_text()
    recipe = _RECIPE.search(text)
    return SlurmScript(path, recipe.group(1) if recipe else None,
                       {key: value or "" for key, value in _OPTION.findall(text)})


def job_scripts(folder: Path | None = None) -> list[SlurmScript]:
    """The scripts of ``folder`` (default :func:`slurm_folder`) that run a recipe of their own, by name."""
    scripts = [read_script(p) for p in sorted((folder or slurm_folder()).glob("*.sh"))]
    return [s for s in scripts if s.recipe is not None]
