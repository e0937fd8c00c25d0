"""The #SBATCH reader (convit_scale/slurm_scripts.py): a job script's options, its recipe, and the job shape read
from them; and the run folder's names and exit statuses as the shell scripts spell them."""

from __future__ import annotations

import re

from support import REPO

from convit_scale import faults, runfolder
from convit_scale.config import recipe_path
from convit_scale.slurm_scripts import job_scripts, read_script

SCRIPT = """#!/bin/bash
#SBATCH --job-name=convit_x
#SBATCH --nodes=2
#SBATCH --ntasks-per-node 4
#SBATCH --cpus-per-task=12
#SBATCH --requeue
#SBATCH --signal=USR1@300
# #SBATCH --nodes=9 is a comment, not an option
RECIPE=${RECIPE:-recipes/convit_x.yaml} exec bash slurm/launch.sh
"""


def test_options_recipe_and_shape_of_one_script(tmp_path):
    path = tmp_path / "convit_x.sh"
    path.write_text(SCRIPT)
    s = read_script(path)
    assert s.recipe == "recipes/convit_x.yaml"
    assert s.options == {"job-name": "convit_x", "nodes": "2", "ntasks-per-node": "4", "cpus-per-task": "12",
                         "requeue": "", "signal": "USR1@300"}
    assert (s.nodes, s.tasks_per_node, s.gpus_per_node, s.cpus_per_task) == (2, 4, 4, 12)  # a GPU per task by default
    assert s.number("time", 60) == 60 and s.hours is None and s.planned is None
    for value, hours in [("8:00:00", 8), ("90", 1.5), ("30:00", 0.5), ("2-12", 60), ("1-2:30", 26.5), ("x", None)]:
        assert _script(tmp_path, f"#SBATCH --time={value}\n").hours == hours, value


def _script(tmp_path, text):
    path = tmp_path / "t.sh"
    path.write_text(text)
    return read_script(path)


def test_job_scripts_are_those_that_run_a_recipe_of_their_own(tmp_path):
    (tmp_path / "convit_x.sh").write_text(SCRIPT)
    (tmp_path / "train.sh").write_text("#!/bin/bash\n#SBATCH --nodes=1\nexec bash slurm/launch.sh\n")
    assert [s.path.name for s in job_scripts(tmp_path)] == ["convit_x.sh"]


def test_the_shipped_job_scripts_run_shipped_recipes():
    scripts = job_scripts()
    assert len(scripts) >= 10
    for s in scripts:
        assert recipe_path(s.recipe).is_file(), s.path
        assert s.nodes >= 1 and s.gpus_per_node == s.tasks_per_node, s.path
        # the pre-timeout signal's lead, which the launcher's restart rule knows (faults.SIGNAL_LEAD_S)
        assert s.options["signal"] == f"USR1@{faults.SIGNAL_LEAD_S}" and "requeue" in s.options, s.path


SHELL_PROTOCOL = {"launch.sh": {"EXIT_BAD_INPUT", "EXIT_NONFINITE", "EXIT_REQUEUE", "CHECKPOINTS", "HANGS",
                                "STOPPED_FOR_REQUEUE"},
                  "eval.sh": {"CHECKPOINTS"}}
"""The names of convit_scale/runfolder.py that a shell script defines for itself (the batch shell cannot import it)."""
FILE_NAMES = ("CHECKPOINTS", "META", "FAULTS", "STARTS", "HEARTBEAT", "HANGS", "LEASE", "STOPPED_FOR_REQUEUE",
              "METRICS")


def test_the_shell_scripts_spell_the_run_folder_as_runfolder_names_it():
    """Each script's copies of runfolder's names equal its constants, and the scripts use the run folder's files
    (``$OUT/hangs``) only through them; launch.sh compares the training's exit statuses only through its copies."""
    for path in sorted((REPO / "slurm").rglob("*.sh")):
        text = path.read_text()
        defined = {k: v for k, v in re.findall(r"^([A-Z_]+)=(\S+?)(?:\s+#.*)?$", text, re.M) if hasattr(runfolder, k)}
        expected = SHELL_PROTOCOL.get(path.name, set())
        assert defined == {k: str(getattr(runfolder, k)) for k in expected}, path
        code = "\n".join(line for line in text.splitlines()
                         if not line.lstrip().startswith("#") and line.split("=")[0] not in defined)
        code = re.sub(r"\$\{?[A-Z_]+\}?", "$VAR", code)  # $NAME, ${NAME}: the copies
        spelt = [n for n in FILE_NAMES if re.search(rf"/{re.escape(getattr(runfolder, n))}\b|"
                                                   rf"\b{re.escape(getattr(runfolder, n))}/", code)]
        assert not spelt, f"{path.name} spells {spelt}: use its copies of runfolder's names"
    launch = (REPO / "slurm" / "launch.sh").read_text()
    statuses = "|".join(str(getattr(runfolder, k)) for k in dir(runfolder) if k.startswith("EXIT_"))
    literal = re.findall(rf"(?:\bexit|-eq|-ne|\*:|\|)\s*({statuses})\b", launch)
    assert not literal, f"launch.sh spells exit statuses {literal}: use its EXIT_* copies of runfolder's"
