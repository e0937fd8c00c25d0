#!/usr/bin/env bash
# The shared launcher behind every slurm/<recipe>.sh. Inputs (environment):
#   RECIPE        recipe file (set by the wrapper)
#   DATA_DIR      prepared data folder (sets data.train_path and data.val_path)
#   OUTPUT_DIR    run folder (default runs/<job name>); checkpoints there survive requeues
#   OVERRIDES     extra dotted overrides, space separated (e.g. "parallel.strategy=zero3 data.num_workers=10")
#   LAUNCHER      srun (default: one task per GPU) or torchrun (one torchrun per node, static rendezvous)
#   PYTHON        interpreter (default .venv/bin/python, else python3)
#   MASTER_ADDR   rendezvous host (default: first node of the job)
#   STOP_GRACE_S  torchrun only: seconds the ranks get, after the pre-timeout signal, to save before
#                 torchrun kills them (default 300; keep it under the script's --signal=USR1@T)
# Exit status 75 from training (or the STOPPED_FOR_REQUEUE marker) means: stopped by the pre-timeout
# signal after a checkpoint; the job requeues itself and resumes from the newest checkpoint.
set -uo pipefail
cd "${SLURM_SUBMIT_DIR:-.}"
PY=${PYTHON:-.venv/bin/python}
[ -x "$PY" ] || PY=python3
: "${RECIPE:?RECIPE is not set}"
OUT=${OUTPUT_DIR:-runs/${SLURM_JOB_NAME:-job}}
args=("run.output_dir=$OUT")
if [ -n "${DATA_DIR:-}" ]; then args+=("data.train_path=$DATA_DIR" "data.val_path=$DATA_DIR"); fi
# shellcheck disable=SC2206
args+=(${OVERRIDES:-})
NODES=${SLURM_JOB_NUM_NODES:-1}
GPUS=${SLURM_GPUS_ON_NODE:-${SLURM_NTASKS_PER_NODE:-1}}
export MASTER_ADDR=${MASTER_ADDR:-$(scontrol show hostnames "${SLURM_JOB_NODELIST:-localhost}" | head -n 1)}
export MASTER_PORT=${MASTER_PORT:-$((20000 + ${SLURM_JOB_ID:-0} % 20000))}  # several jobs may share a node
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-${SLURM_CPUS_PER_TASK:-1}}

echo "== convit-scale job ${SLURM_JOB_ID:-?} (${SLURM_JOB_NAME:-}) restart ${SLURM_RESTART_COUNT:-0} on ${SLURM_JOB_NODELIST:-?}"
echo "== nodes $NODES, tasks/GPUs per node $GPUS, launcher ${LAUNCHER:-srun}, master $MASTER_ADDR:$MASTER_PORT"
echo "== recipe $RECIPE, output $OUT, overrides: ${args[*]}"
# Validate (and print) the resolved recipe before any training process starts.
"$PY" -m convit_scale.cli config "$RECIPE" "${args[@]}" | sed 's/^/   /' || { echo "error: recipe refused"; exit 2; }

if [ "${LAUNCHER:-srun}" = torchrun ]; then
    # Slurm signals the task, torchrun, whose ranks run in their own sessions: torchrun must forward
    # USR1 (it forwards TERM/INT/HUP/QUIT only by default) and give the ranks time to save.
    export PET_SIGNALS_TO_HANDLE=SIGTERM,SIGINT,SIGHUP,SIGQUIT,SIGUSR1
    export PET_SHUTDOWN_TIMEOUT=${STOP_GRACE_S:-300}
    srun --ntasks-per-node=1 --kill-on-bad-exit=1 bash -c "exec '$PY' -m torch.distributed.run \
        --nnodes=$NODES --nproc-per-node=$GPUS --node-rank=\$SLURM_NODEID \
        --master-addr=$MASTER_ADDR --master-port=$MASTER_PORT \
        -m convit_scale.train --recipe '$RECIPE' $(printf "'%s' " "${args[@]}")"
else
    srun --kill-on-bad-exit=1 "$PY" -m convit_scale.train --recipe "$RECIPE" "${args[@]}"
fi
rc=$?
if [ $rc -eq 75 ] || [ -f "$OUT/STOPPED_FOR_REQUEUE" ]; then
    echo "== stopped before the time limit with a checkpoint; requeueing job ${SLURM_JOB_ID:-?}"
    scontrol requeue "${SLURM_JOB_ID}"
    exit 0
fi
echo "== training exited with status $rc"
exit $rc
