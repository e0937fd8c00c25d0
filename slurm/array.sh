#!/usr/bin/env bash
# Every recipe of a folder (a table of the paper) as one Slurm job array: task i runs the i-th recipe, in name order,
# through launch.sh (its own run folder, checkpoints, requeue and restarts, as slurm/train.sh). Submit from the
# repository root, with --array covering the folder's recipes and each task's shape on the command line:
#   RECIPES=recipes/table3 DATA_DIR=/data/imagenet-ffcv sbatch --array=0-13%4 --nodes=2 slurm/array.sh
#   RECIPES=recipes/appendix DATA_DIR=/data/imagenet100-ffcv sbatch --array=0-10 slurm/array.sh
# (%4: at most 4 tasks at a time). `ls RECIPES/*.yaml` lists the order. Inputs (environment): RECIPES (a folder of
# recipes), and launch.sh's: DATA_DIR, OVERRIDES, LAUNCHER, PYTHON, SITE_SCRIPT, ... (OUTPUT_DIR is refused: every
# recipe has its own run.output_dir).
#SBATCH --job-name=convit-array
#SBATCH --nodes=1
#SBATCH --ntasks-per-node=8
#SBATCH --gpus-per-node=8
#SBATCH --cpus-per-task=10
#SBATCH --time=24:00:00
#SBATCH --signal=USR1@300
#SBATCH --requeue
#SBATCH --open-mode=append
#SBATCH --output=slurm-%x-%A_%a.out
set -uo pipefail
cd "${SLURM_SUBMIT_DIR:-.}"
if [ -z "${RECIPES:-}" ] || [ ! -d "$RECIPES" ]; then
    echo "error: RECIPES=${RECIPES:-} is not a folder; allowed: a folder of recipes, e.g. RECIPES=recipes/table3 sbatch --array=0-13 slurm/array.sh" >&2
    exit 2
fi
if [ -n "${OUTPUT_DIR:-}" ]; then
    echo "error: OUTPUT_DIR=$OUTPUT_DIR is not allowed with slurm/array.sh: every recipe runs in its own run.output_dir" >&2
    exit 2
fi
recipes=()
while IFS= read -r path; do recipes+=("$path"); done < <(find "$RECIPES" -maxdepth 1 -name '*.yaml' | LC_ALL=C sort)
n=${#recipes[@]}
task=${SLURM_ARRAY_TASK_ID:-}
if [ -z "$task" ]; then
    echo "error: slurm/array.sh runs as a job array; allowed: sbatch --array=0-$((n - 1)) slurm/array.sh ($n recipe(s) in $RECIPES)" >&2
    exit 2
fi
if [ "$n" -eq 0 ] || [ "$task" -ge "$n" ]; then
    echo "error: array task $task has no recipe: $RECIPES holds $n; allowed: --array=0-$((n - 1))" >&2
    exit 2
fi
echo "== array task $task of $n: ${recipes[$task]}"
RECIPE=${recipes[$task]} exec bash "${SLURM_SUBMIT_DIR:-.}/slurm/launch.sh"
