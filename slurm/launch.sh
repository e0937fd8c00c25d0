#!/usr/bin/env bash
# The shared launcher behind slurm/train.sh and every slurm/<recipe>.sh. Inputs (environment):
#   RECIPE        recipe file (set by the wrapper; slurm/train.sh takes any)
#   DATA_DIR      prepared data folder (sets data.train_path and data.val_path)
#   OUTPUT_DIR    run folder (default: the recipe's run.output_dir, as `convit-scale train` uses it); checkpoints
#                 there survive requeues
#   OVERRIDES     extra dotted overrides, space separated (e.g. "parallel.strategy=zero3 data.num_workers=10")
#   LAUNCHER      srun (default: one task per GPU) or torchrun (one torchrun per node, static rendezvous;
#                 needs a torch whose torchrun has --signals-to-handle, torch 2.9 and later)
#   PYTHON        the ranks' interpreter (default .venv/bin/python, else python3); the checks before training run it
#                 in a one-task srun step (inside the site's container, with SRUN_ARGS), not in the batch shell
#   HOST_PYTHON   the batch shell's interpreter for the fault bookkeeping (convit_scale.faults: the standard library
#                 alone, from this checkout; default PYTHON where the batch shell has it, else python3): the host
#                 needs no torch
#   SITE_SCRIPT   site settings sourced first (default slurm/site.sh when it exists; see slurm/site.example.sh):
#                 modules, NCCL_*/GLOO_* (passed to every rank), SRUN_ARGS (options for the srun steps, e.g. a
#                 container), and any of these variables
#   MASTER_ADDR   rendezvous host (default: first node of the job)
#   MASTER_PORT   rendezvous port (default: 10000 + SLURM_JOB_ID % 20000, below the ephemeral range)
#   STOP_GRACE_S  torchrun only: seconds the ranks get, after the pre-timeout signal, to save before
#                 torchrun kills them (default 240; keep it under the script's --signal=USR1@T, 300, which
#                 must also leave the time the requeue takes)
#   MAX_REQUEUES  how many times the job may requeue itself (default 50), compared with SLURM_RESTART_COUNT
#   MAX_RESTARTS  how many new srun steps one allocation may start after unplanned failures (default 10)
# CPUs: each rank gets its share of the job's CPUs and as many OpenMP threads (OMP_NUM_THREADS): srun
# gives every task --cpus-per-task; torchrun gets all of the node's CPUs and splits them among its ranks.
# Node range: sbatch --nodes=MIN-MAX starts (and restarts after a requeue) on any count in it whose ranks are at
# most the recipe's data.canonical_groups (checked below, before any rank starts): ConViT-B+ (32 groups) continues on
# 3 of its 4 nodes (24 ranks, unequal shares). The requeue
# below asks again for the range (Slurm would otherwise keep the task count of the last allocation).
# Requeue: after the pre-timeout signal the ranks save, exit with 75, and rank 0 writes
# $OUTPUT_DIR/STOPPED_FOR_REQUEUE. The job requeues itself (and resumes from the newest checkpoint) only
# when that marker was written during this run's training step AND the step's exit status is one a stop
# gives (75, or what srun and torchrun make of it; see below).
# Unplanned failures (docs/failures.md): a rank that crashes, runs out of memory, hangs (its watchdog, or another
# rank's, ends it) or a node that is lost ends the srun step; python -m convit_scale.faults writes one line here and a
# record in $OUT/faults.jsonl, and the job resumes from the newest checkpoint by itself: a new srun step inside the
# allocation while all its nodes are healthy (no queue wait), else a requeue onto the nodes Slurm still has (a node
# range job continues on fewer). Only when the run made progress since the last start (a newer checkpoint): the same
# failure at the same step twice ends the job with a one-line diagnosis.
set -uo pipefail
cd "${SLURM_SUBMIT_DIR:-.}"
source "$(dirname "${BASH_SOURCE[0]}")/site_hook.sh"  # SITE_SCRIPT, SRUN_ARGS, site_report
# The run folder's protocol as convit_scale/runfolder.py names it (tests/test_slurm_scripts.py checks that these are
# its constants): the training's exit statuses (this script's own refusals are bad input too) and its files here.
EXIT_BAD_INPUT=2
EXIT_NONFINITE=3
EXIT_REQUEUE=75
CHECKPOINTS=checkpoints
HANGS=hangs
STOPPED_FOR_REQUEUE=STOPPED_FOR_REQUEUE
LAUNCHER=${LAUNCHER:-srun}
case "$LAUNCHER" in
    srun | torchrun) ;;
    *) echo "error: LAUNCHER=$LAUNCHER is not supported; allowed: srun (one task per GPU) or torchrun (one per node)" >&2
       exit "$EXIT_BAD_INPUT" ;;
esac
MAX_REQUEUES=${MAX_REQUEUES:-50}
if ! [[ "$MAX_REQUEUES" =~ ^[0-9]+$ ]]; then
    echo "error: MAX_REQUEUES=$MAX_REQUEUES is not allowed; use a whole number >= 0 (default 50)" >&2
    exit "$EXIT_BAD_INPUT"
fi
MAX_RESTARTS=${MAX_RESTARTS:-10}
if ! [[ "$MAX_RESTARTS" =~ ^[0-9]+$ ]]; then
    echo "error: MAX_RESTARTS=$MAX_RESTARTS is not allowed; use a whole number >= 0 (default 10)" >&2
    exit "$EXIT_BAD_INPUT"
fi
CHECKOUT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
HOST_PY=${HOST_PYTHON:-$PY}
command -v "$HOST_PY" >/dev/null 2>&1 || HOST_PY=python3
# The Python work before training (the recipe's checks) runs where the ranks run: a one-task srun step, inside the
# site's container (SRUN_ARGS) with its torch; outside an allocation, here.
where_ranks_run() {
    if [ -n "${SLURM_JOB_ID:-}" ]; then
        # shellcheck disable=SC2086
        srun --nodes=1 --ntasks=1 --ntasks-per-node=1 --kill-on-bad-exit=1 $SRUN_ARGS "$@"
    else
        "$@"
    fi
}
# The fault bookkeeping between steps runs in this shell: the standard library alone, from this checkout.
faults() {
    PYTHONPATH="$CHECKOUT${PYTHONPATH:+:$PYTHONPATH}" "$HOST_PY" -m convit_scale.faults "$@"
}
if [ -z "${RECIPE:-}" ]; then
    echo "error: RECIPE is not set; allowed: a recipe file, e.g. RECIPE=recipes/table3/convit_small_plus_b_full.yaml sbatch slurm/train.sh" >&2
    exit "$EXIT_BAD_INPUT"
fi
args=()
if [ -n "${DATA_DIR:-}" ]; then args+=("data.train_path=$DATA_DIR" "data.val_path=$DATA_DIR"); fi
# shellcheck disable=SC2206
args+=(${OVERRIDES:-})
# One run folder per recipe whatever launches it: the recipe's run.output_dir (after the overrides), unless
# OUTPUT_DIR names another.
if [ -n "${OUTPUT_DIR:-}" ]; then
    OUT=$OUTPUT_DIR
    out_note="OUTPUT_DIR"
else
    # (the last line, without the task label a site's SRUN_ARGS=--label puts before it)
    OUT=$(where_ranks_run "$PY" -m convit_scale.cli config --recipe "$RECIPE" --get run.output_dir "${args[@]}" \
        | sed -E 's/^[0-9]+: //' | tail -n 1) || exit "$EXIT_BAD_INPUT"
    out_note="the recipe's run.output_dir"
fi
args=("run.output_dir=$OUT" "${args[@]}")
MARKER="$OUT/$STOPPED_FOR_REQUEUE"
NODES=${SLURM_JOB_NUM_NODES:-1}
GPUS=${SLURM_GPUS_ON_NODE:-${SLURM_NTASKS_PER_NODE:-1}}  # ranks per node
[ "$GPUS" -ge 1 ] 2>/dev/null || GPUS=1
# sbatch exports the submitting shell's environment: a launcher's per-process variables from there (an interactive
# torchrun, a container's defaults) would make every task a lone rank 0 of 1. The ranks get theirs from srun/torchrun.
unset RANK WORLD_SIZE LOCAL_RANK LOCAL_WORLD_SIZE GROUP_RANK ROLE_RANK TORCHELASTIC_RUN_ID TORCHELASTIC_RESTART_COUNT
export MASTER_ADDR=${MASTER_ADDR:-$(scontrol show hostnames "${SLURM_JOB_NODELIST:-localhost}" | head -n 1)}
# by job id: jobs sharing a node differ; below Linux's ephemeral ports (32768+), which a node's connections may hold
export MASTER_PORT=${MASTER_PORT:-$((10000 + ${SLURM_JOB_ID:-0} % 20000))}

# CPUs. Since Slurm 22.05 srun does not inherit the job's --cpus-per-task: without an explicit one every
# task gets a single CPU, and torchrun's ranks with all their loader workers would share it.
tasks_layout=${SLURM_TASKS_PER_NODE:-1}  # e.g. "8(x2)"
TASKS_PER_NODE=${SLURM_NTASKS_PER_NODE:-${tasks_layout%%[(,]*}}
NODE_CPUS=${SLURM_CPUS_ON_NODE:-$((TASKS_PER_NODE * ${SLURM_CPUS_PER_TASK:-1}))}  # the job's CPUs on a node
if [ "$LAUNCHER" = torchrun ]; then
    STEP_CPUS=$NODE_CPUS                                     # one torchrun task per node holds them all
    RANK_CPUS=$((NODE_CPUS / GPUS))
    cpu_note="node CPUs $NODE_CPUS / $GPUS rank(s) per node"
else
    RANK_CPUS=${SLURM_CPUS_PER_TASK:-$((NODE_CPUS / TASKS_PER_NODE))}
    STEP_CPUS=$RANK_CPUS
    cpu_note="--cpus-per-task=$STEP_CPUS per task"
fi
[ "$RANK_CPUS" -ge 1 ] || RANK_CPUS=1
[ "$STEP_CPUS" -ge 1 ] || STEP_CPUS=1
# OpenMP threads: the rank's CPUs, but never more than this node's cores give each of its ranks. Slurm's CPU count can
# exceed the cores a node has (CPUs= configured above them, OverSubscribe): OpenMP's spinning threads then outnumber
# the cores many times over and every rank's step waits on them. nproc: the cores this job may use on the node.
ranks_on_node=$([ "$LAUNCHER" = torchrun ] && echo "$GPUS" || echo "$TASKS_PER_NODE")
node_cores=$(nproc 2>/dev/null || echo $((RANK_CPUS * ranks_on_node)))
fair_threads=$((node_cores / ranks_on_node))
[ "$fair_threads" -ge 1 ] || fair_threads=1
OMP_NUM_THREADS=$RANK_CPUS
if [ "$fair_threads" -lt "$RANK_CPUS" ]; then
    OMP_NUM_THREADS=$fair_threads
    cpu_note="$cpu_note; OpenMP threads $fair_threads: $node_cores core(s) on this node for $ranks_on_node rank(s)"
fi
export OMP_NUM_THREADS

echo "== convit-scale job ${SLURM_JOB_ID:-?} (${SLURM_JOB_NAME:-}) restart ${SLURM_RESTART_COUNT:-0} on ${SLURM_JOB_NODELIST:-?}"
echo "== nodes $NODES, tasks/GPUs per node $GPUS, launcher $LAUNCHER, master $MASTER_ADDR:$MASTER_PORT"
echo "== CPUs per rank $RANK_CPUS ($cpu_note), OMP_NUM_THREADS=$OMP_NUM_THREADS"
echo "== recipe $RECIPE, output $OUT ($out_note), overrides: ${args[*]}"
site_report

if [ "$LAUNCHER" = torchrun ]; then
    # Slurm's pre-timeout signal reaches torchrun, not its ranks (they run in their own sessions).
    # torchrun forwards USR1 only when told to (--signals-to-handle, torch 2.9 and later): an older one dies
    # of it and takes the ranks with it, unsaved. Test for the option, not for a version.
    tv=$(where_ranks_run "$PY" -c "import sys
from torch.distributed.run import get_args_parser
import torch
opts = {o for a in get_args_parser()._actions for o in a.option_strings}
print(torch.__version__, '--shutdown-timeout' in opts)
sys.exit(0 if '--signals-to-handle' in opts else 3)" 2>/dev/null | sed -E 's/^[0-9]+: //' | tail -n 1)
    case $? in
        0) ;;
        3) echo "error: LAUNCHER=torchrun needs torchrun --signals-to-handle (torch>=2.9) to forward Slurm's USR1 to the ranks; torch ${tv%% *} lacks it: use LAUNCHER=srun or a newer torch" >&2
           exit "$EXIT_BAD_INPUT" ;;
        *) echo "error: LAUNCHER=torchrun: $PY cannot import torch.distributed.run" >&2
           exit "$EXIT_BAD_INPUT" ;;
    esac
    if [ "${tv##* }" != True ]; then
        echo "== warning: torch ${tv%% *} has no torchrun --shutdown-timeout: the ranks get torchrun's fixed 30 s, not STOP_GRACE_S, to save after the signal"
    fi
fi
# Validate (and print) the resolved recipe before any training process starts, on this job's world size: each rank
# holds whole canonical groups of the global batch (data.canonical_groups; unequal numbers of them where the ranks do
# not divide them, the loss weighted by each rank's samples), so a job submitted with a node range (sbatch
# --nodes=2-4) runs, and resumes any checkpoint of the run, on any count of nodes with no more ranks than groups;
# only the speed changes (the same global batch; with unequal shares the busiest ranks set the step's time). More
# ranks than groups are refused here, before srun, and the job is not requeued. So is data that the ranks could not
# read: the train and val folders (DATA_DIR, else the recipe's data paths) are checked against their manifest.json, as
# every rank's preflight would, in one line naming DATA_DIR and what the recipe's data.format reads.
data_from="DATA_DIR=${DATA_DIR:-}"
[ -n "${DATA_DIR:-}" ] || data_from="DATA_DIR is not set (the recipe's data paths)"
where_ranks_run "$PY" -m convit_scale.cli config --recipe "$RECIPE" --world-size "$((NODES * GPUS))" \
    --check-data "$data_from" "${args[@]}" \
    | sed 's/^/   /' \
    || { echo "error: recipe refused"; exit "$EXIT_BAD_INPUT"; }

# A marker left by an earlier run must not requeue this one: only a marker written by this step counts.
clear_marker() {
    rm -f "$MARKER"
    if [ -e "$MARKER" ]; then
        echo "error: cannot remove the stale requeue marker $MARKER" >&2
        exit "$EXIT_BAD_INPUT"
    fi
}

# One training step of the job (srun), its messages (srun's and the ranks' standard error) also in $STEP_LOG for the
# diagnosis of a failure.
run_training() {
    if [ "$LAUNCHER" = torchrun ]; then
        export PET_SIGNALS_TO_HANDLE=SIGTERM,SIGINT,SIGHUP,SIGQUIT,SIGUSR1
        export PET_SHUTDOWN_TIMEOUT=${STOP_GRACE_S:-240}
        # One task per node (explicit --ntasks: the job's SLURM_NTASKS would ask for one per GPU) with all of
        # the node's CPUs, unbound, for torchrun to share among its ranks.
        # shellcheck disable=SC2086
        srun --nodes="$NODES" --ntasks="$NODES" --ntasks-per-node=1 --cpus-per-task="$STEP_CPUS" --cpu-bind=none \
            --kill-on-bad-exit=1 $SRUN_ARGS bash -c "echo \"== node \$SLURM_NODEID: torchrun has \$SLURM_CPUS_PER_TASK CPUs, \
ranks get OMP_NUM_THREADS=\$OMP_NUM_THREADS\"; exec '$PY' -m torch.distributed.run \
            --nnodes=$NODES --nproc-per-node=$GPUS --node-rank=\$SLURM_NODEID \
            --master-addr=$MASTER_ADDR --master-port=$MASTER_PORT \
            -m convit_scale.train --recipe '$RECIPE' $(printf "'%s' " "${args[@]}")"
    else
        # Explicit counts: the job's own SLURM_NTASKS is its submission's after a requeue onto fewer nodes.
        # shellcheck disable=SC2086
        srun --nodes="$NODES" --ntasks="$((NODES * TASKS_PER_NODE))" --ntasks-per-node="$TASKS_PER_NODE" \
            --cpus-per-task="$STEP_CPUS" --kill-on-bad-exit=1 $SRUN_ARGS "$PY" -m convit_scale.train --recipe "$RECIPE" \
            "${args[@]}"
    fi
}

# Requeue the job (it resumes from the newest checkpoint), at most MAX_REQUEUES times; ends this script.
requeue_job() {
    local restarts=${SLURM_RESTART_COUNT:-0}
    if [ "$restarts" -ge "$MAX_REQUEUES" ]; then
        echo "error: job ${SLURM_JOB_ID:-?} $1 but was already requeued $restarts times (MAX_REQUEUES=$MAX_REQUEUES); not requeueing: resubmit to resume from $OUT/$CHECKPOINTS" >&2
        exit 1
    fi
    echo "== $2; requeueing job ${SLURM_JOB_ID:-?} ($((restarts + 1)) of at most $MAX_REQUEUES)"
    # The requeue ends this script (SIGTERM, SIGKILL after the cluster's KillWait): it first asks for the node
    # range again (below).
    trap '' TERM
    if ! scontrol requeue "${SLURM_JOB_ID:-}"; then
        echo "error: scontrol requeue ${SLURM_JOB_ID:-?} failed (the job needs --requeue); resubmit to resume from $OUT/$CHECKPOINTS" >&2
        exit 1
    fi
    # A requeued job keeps the task and CPU counts of the allocation it had (seen with Slurm 22.05), so a job
    # submitted with a node range (sbatch --nodes=MIN-MAX) would restart only on as many nodes as before: ask for
    # one node's worth again; Slurm raises both to what the nodes it gives hold (--ntasks-per-node), and the
    # range's MIN still holds.
    if ! scontrol update JobId="${SLURM_JOB_ID:-}" NumTasks="$TASKS_PER_NODE" \
            NumCPUs="$((TASKS_PER_NODE * ${SLURM_CPUS_PER_TASK:-1}))"; then
        echo "warning: could not reset the requeued job's task and CPU counts: it restarts on $NODES node(s) only" >&2
    fi
    exit 0
}

# NCCL's flight recorder, where the recipe turns it on (fault.nccl_trace_entries; each rank sets its size before its
# process group forms), keeps the last collectives of every rank; the watchdog writes it with its stacks, and NCCL
# itself on a collective timeout (into the run folder's hangs/).
mkdir -p "$OUT/$HANGS"
export TORCH_NCCL_DUMP_ON_TIMEOUT=${TORCH_NCCL_DUMP_ON_TIMEOUT:-1}
export TORCH_NCCL_DEBUG_INFO_TEMP_FILE=${TORCH_NCCL_DEBUG_INFO_TEMP_FILE:-$OUT/$HANGS/nccl_trace_rank_}
JOB_NODES=$(scontrol show hostnames "${SLURM_JOB_NODELIST:-}" 2>/dev/null | paste -sd, -)
STEP_LOG="$OUT/$HANGS/last_step.err"
attempt=0
while :; do
    clear_marker
    faults start --out "$OUT" --job "${SLURM_JOB_ID:-}" --restart "${SLURM_RESTART_COUNT:-0}" \
        --nodes "$JOB_NODES"
    : > "$STEP_LOG"
    run_training 2> >(tee -a "$STEP_LOG" >&2)
    rc=$?
    wait $! 2>/dev/null  # tee has written every line of the step
    stopped=no
    if [ -f "$MARKER" ]; then
        # The step's status after a stop: 75; or 143/137 when the first task to exit with 75 made srun
        # (--kill-on-bad-exit) end the others before they exited themselves (srun reports the highest
        # status, a signal as 128+N); torchrun: 1, which torch.distributed.run returns when its ranks exit
        # non-zero, 75 included.
        case "$LAUNCHER:$rc" in
            *:"$EXIT_REQUEUE" | *:143 | *:137 | torchrun:1) stopped=yes ;;
        esac
    fi
    if [ $stopped = yes ]; then
        faults close --out "$OUT" --outcome stopped || echo "warning: faults close could not record the stop" >&2
        requeue_job "stopped with a checkpoint" "stopped before the time limit with a checkpoint"
    fi
    if [ $rc -eq "$EXIT_REQUEUE" ]; then
        echo "== training exited with $EXIT_REQUEUE but wrote no $MARKER in this run: not requeueing"
    elif [ -f "$MARKER" ]; then
        echo "== $MARKER is ignored: training exited with status $rc"
    fi
    # Finished (0), refused (2: bad input, data) or stopped by the non-finite policy (3): no restart repeats it.
    case $rc in 0 | "$EXIT_BAD_INPUT" | "$EXIT_NONFINITE" | "$EXIT_REQUEUE")
        faults close --out "$OUT" --outcome "exit $rc" || echo "warning: faults close could not record the exit" >&2
        echo "== training exited with status $rc"; exit $rc ;;
    esac
    # An unplanned failure (a crash, an OOM, a hang ended by the watchdog, a lost node, a save the file system
    # refused: 77): one line and a record in $OUT/faults.jsonl, then a restart from the newest checkpoint if the run
    # made progress since this start; never a second restart into a storage failure. The statuses and the run
    # folder's files are convit_scale/runfolder.py's.
    action=$(faults end --out "$OUT" --rc "$rc" --log "$STEP_LOG" --nodes "$JOB_NODES" \
        --max-restarts "$MAX_RESTARTS") || { action=stop; faults close --out "$OUT" --outcome "exit $rc"; }
    case $action in
        restart)
            attempt=$((attempt + 1))
            echo "== restart $attempt of at most $MAX_RESTARTS in this allocation: a new srun step from the newest checkpoint" ;;
        requeue)  # a node of the allocation is down or drained, or the time limit is too close (the line above)
            requeue_job "needs a new allocation" "the next start needs a new allocation" ;;
        *)
            echo "== training exited with status $rc"
            exit $rc ;;
    esac
done
