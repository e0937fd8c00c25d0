"""Documents that quote a tool's output quote what the tool prints now: docs/planning.md's `plan` of ConViT-B+ and
BENCHMARKS.md's table of the Slurm jobs (both at this machine's decode, the figure a plan without calibration uses),
the ConViT-B+ recipes' comment on their layout, and each Slurm job script's --time (derived from its job's plan)."""

from __future__ import annotations

import re

import pytest
from support import REPO

from convit_scale.cli import main
from convit_scale.planner import DECODE_MS_HERE
from convit_scale.slurm_scripts import TIME_MARGIN, job_scripts, time_limit_hours


@pytest.fixture
def here(tmp_path, monkeypatch, capsys):
    """``plan`` run from the checkout, with this machine's decode as the node's calibration; returns its output."""
    cal = tmp_path / "calibration.json"
    cal.write_text(f'{{"decode_cpu_ms_per_image": {DECODE_MS_HERE}}}')
    monkeypatch.setenv("CONVIT_SCALE_CALIBRATION", str(cal))
    monkeypatch.delenv("COLUMNS", raising=False)
    monkeypatch.chdir(REPO)

    def run(*argv: str) -> str:
        capsys.readouterr()
        assert main(["plan", *argv]) == 0
        return capsys.readouterr().out

    return run


def test_planning_doc_quotes_plan(here):
    text = (REPO / "docs" / "planning.md").read_text()
    quoted = re.search(r"```text\n(the job's shape from slurm/convit_b_plus\.sh.*?)```", text, re.S).group(1)
    assert quoted == here("--recipe", "recipes/table1/convit_base_plus.yaml", "--gpu", "h200-141gb")


def test_benchmarks_planning_table_and_recipe_comments_quote_plan(here):
    out = here("--slurm-jobs", "--gpu", "h200-141gb")
    tool = {c[0]: c for c in ([x.strip() for x in ln.strip().strip("│").split("│")] for ln in out.splitlines()
                              if ln.startswith("│ "))}
    text = (REPO / "BENCHMARKS.md").read_text()
    section = text[text.index("## Planning: Table 1's jobs"):text.index("## Elastic resume")]
    rows = [[x.strip() for x in ln.strip("|").split("|")] for ln in section.splitlines() if ".sh` |" in ln]
    assert len(rows) == len(tool) == 15
    for row in rows:
        t = tool[row[1].strip("`")]
        assert row[2:] == [t[1], t[2], *t[4:]], row[0]
    step = tool["convit_b_plus.sh"][9]
    for recipe in ("convit_base_plus", "deit_base_plus"):
        assert f"{step} ms per step" in (REPO / "recipes" / "table1" / f"{recipe}.yaml").read_text()
    # each job script's --time: TIME_MARGIN x the wall-clock hours of its row, which its comment quotes
    for script in job_scripts(REPO / "slurm"):
        hours = float(tool[script.path.name][10])
        assert script.planned == (TIME_MARGIN, hours), script.path.name
        assert script.hours == time_limit_hours(hours), script.path.name
