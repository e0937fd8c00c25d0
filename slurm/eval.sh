#!/usr/bin/env bash
# Evaluate a checkpoint on one GPU: top-1/top-5 on the validation split, the images seen as the run's own evaluation
# saw them (its crop ratio and interpolation), written as JSON. Submit from the repository root:
#   CHECKPOINT=runs/table1/convit_base_plus:best DATA_DIR=/data/imagenet-ffcv sbatch slurm/eval.sh
# or chained to the training job (it starts once training has ended well):
#   job=$(DATA_DIR=/data/imagenet-ffcv sbatch --parsable slurm/convit_b_plus.sh)
#   CHECKPOINT=runs/table1/convit_base_plus:best DATA_DIR=/data/imagenet-ffcv sbatch --dependency=afterok:$job slurm/eval.sh
# Inputs (environment): CHECKPOINT (a run folder: its newest checkpoint; RUN:latest; RUN:best; a checkpoint folder;
# an exported .safetensors; published weights with EVAL_ARGS="--model NAME"), DATA_DIR (a prepared folder or an
# ImageFolder root), RESULTS (the JSON file; default: eval-<checkpoint name>.json in the run folder when CHECKPOINT
# names one, else beside the job's log), EVAL_ARGS (more options of `convit-scale eval`: --crop-ratio, --img-size, ...),
# PYTHON, SITE_SCRIPT (the site's settings, as for training: slurm/site.example.sh).
#SBATCH --job-name=convit-eval
#SBATCH --nodes=1
#SBATCH --ntasks=1
#SBATCH --gpus-per-node=1
#SBATCH --cpus-per-task=16
#SBATCH --time=2:00:00
#SBATCH --output=slurm-%x-%j.out
set -uo pipefail
cd "${SLURM_SUBMIT_DIR:-.}"
source slurm/site_hook.sh  # SITE_SCRIPT, SRUN_ARGS, site_report
CHECKPOINTS=checkpoints  # a run folder's, as convit_scale/runfolder.py names it (tests/test_slurm_scripts.py)
for var in CHECKPOINT DATA_DIR; do
    if [ -z "${!var:-}" ]; then
        echo "error: $var is not set; e.g. CHECKPOINT=runs/table1/convit_base_plus:best DATA_DIR=/data/imagenet-ffcv sbatch slurm/eval.sh" >&2
        exit 2
    fi
done
CPUS=${SLURM_CPUS_PER_TASK:-$(nproc)}
run=${CHECKPOINT%:best}
run=${run%:latest}
if [ -z "${RESULTS:-}" ]; then
    name=$(basename "$run")
    case "$CHECKPOINT" in *:best) name="$name-best" ;; *:latest) name="$name-latest" ;; esac
    if [ -d "$run/$CHECKPOINTS" ]; then RESULTS="$run/eval-$name.json"; else RESULTS="eval-$name-${SLURM_JOB_ID:-0}.json"; fi
fi
echo "== convit-scale eval job ${SLURM_JOB_ID:-?} on ${SLURM_JOB_NODELIST:-?}: $CHECKPOINT on $DATA_DIR, $CPUS CPUs"
echo "== results: $RESULTS ${EVAL_ARGS:-}"
site_report
# shellcheck disable=SC2086
srun --ntasks=1 --cpus-per-task="$CPUS" $SRUN_ARGS "$PY" -m convit_scale.cli eval --checkpoint "$CHECKPOINT" \
    --data "$DATA_DIR" --workers "$((CPUS > 1 ? CPUS - 1 : 1))" --results-file "$RESULTS" ${EVAL_ARGS:-}
rc=$?
echo "== eval exited with status $rc"
exit $rc
