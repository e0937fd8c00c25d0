#!/usr/bin/env bash
# Convert ImageNet once, on one node with all the CPUs the job gets (the longest CPU job: hours for the full
# train set). Submit from the repository root:
#   FORMAT=ffcv SRC=/data/imagenet OUT=/data/imagenet-ffcv sbatch slurm/prep.sh
#   FORMAT=wds SRC=/data/imagenet OUT=/data/in-wds-10 PREP_ARGS="--subset-fraction 0.1" sbatch slurm/prep.sh
# Inputs (environment): FORMAT (ffcv or wds), SRC, OUT, PREP_ARGS (more options of `convit-scale prep FORMAT`),
# VERIFY (1, the default: `prep verify OUT --src SRC` after the conversion; 0: not), PYTHON, SITE_SCRIPT (the site's
# settings, as for training: slurm/site.example.sh). Interrupted, requeued or resubmitted, the conversion resumes:
# finished shards are not redone. CPUs: --cpus-per-task below, or sbatch's command line (-c 128).
#SBATCH --job-name=convit-prep
#SBATCH --nodes=1
#SBATCH --ntasks=1
#SBATCH --cpus-per-task=64
#SBATCH --time=24:00:00
#SBATCH --requeue
#SBATCH --open-mode=append
#SBATCH --output=slurm-%x-%j.out
set -uo pipefail
cd "${SLURM_SUBMIT_DIR:-.}"
source slurm/site_hook.sh  # SITE_SCRIPT, SRUN_ARGS, site_report
case "${FORMAT:-}" in
    ffcv | wds) ;;
    *) echo "error: FORMAT=${FORMAT:-} is not allowed; allowed: ffcv or wds" >&2; exit 2 ;;
esac
for var in SRC OUT; do
    if [ -z "${!var:-}" ]; then echo "error: $var is not set; e.g. FORMAT=ffcv SRC=/data/imagenet OUT=/data/imagenet-ffcv sbatch slurm/prep.sh" >&2; exit 2; fi
done
VERIFY=${VERIFY:-1}
case "$VERIFY" in 0 | 1) ;; *) echo "error: VERIFY=$VERIFY is not allowed; allowed: 1 (verify after converting) or 0" >&2; exit 2 ;; esac
CPUS=${SLURM_CPUS_PER_TASK:-$(nproc)}
echo "== convit-scale prep job ${SLURM_JOB_ID:-?} restart ${SLURM_RESTART_COUNT:-0} on ${SLURM_JOB_NODELIST:-?}: $FORMAT, $CPUS CPUs"
echo "== $SRC -> $OUT ${PREP_ARGS:-}"
site_report
# shellcheck disable=SC2086
srun --ntasks=1 --cpus-per-task="$CPUS" $SRUN_ARGS "$PY" -m convit_scale.cli prep "$FORMAT" --src "$SRC" --out "$OUT" \
    --workers "$CPUS" ${PREP_ARGS:-}
rc=$?
if [ $rc -ne 0 ]; then
    echo "== prep exited with status $rc"
    exit $rc
fi
if [ "$VERIFY" = 1 ]; then
    # shellcheck disable=SC2086
    srun --ntasks=1 --cpus-per-task="$CPUS" $SRUN_ARGS "$PY" -m convit_scale.cli prep verify "$OUT" --src "$SRC"
    rc=$?
fi
echo "== prep exited with status $rc"
exit $rc
