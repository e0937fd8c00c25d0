# Sourced by slurm/launch.sh, prep.sh and eval.sh before anything else: the site's own settings. SITE_SCRIPT names
# the file (default slurm/site.sh beside this one, which git ignores; slurm/site.example.sh shows what goes in it).
# It is plain bash run in the job's shell: module loads, exported NCCL_*/GLOO_* settings (srun and torchrun pass the
# job's environment on to every rank), SRUN_ARGS (options for every srun step, e.g. a container), PYTHON, LAUNCHER.
_site_default="$(dirname "${BASH_SOURCE[0]}")/site.sh"
SITE_SCRIPT=${SITE_SCRIPT:-$_site_default}
if [ -f "$SITE_SCRIPT" ]; then
    # shellcheck disable=SC1090
    source "$SITE_SCRIPT" || { echo "error: SITE_SCRIPT=$SITE_SCRIPT failed (status $?)" >&2; exit 2; }
    SITE_NOTE="$SITE_SCRIPT"
elif [ "$SITE_SCRIPT" != "$_site_default" ]; then
    echo "error: SITE_SCRIPT=$SITE_SCRIPT is not a file; allowed: a bash file of site settings (see slurm/site.example.sh)" >&2
    exit 2
else
    SITE_NOTE="none (no $SITE_SCRIPT)"
fi
SRUN_ARGS=${SRUN_ARGS:-}
# The jobs' Python (every script runs it inside its srun steps): a PYTHON the site names is kept as given, even where
# the batch shell cannot see it (a container's interpreter exists only inside the steps); the default is the
# checkout's .venv/bin/python, else python3.
PY=${PYTHON:-.venv/bin/python}
[ -n "${PYTHON:-}" ] || [ -x "$PY" ] || PY=python3

# The header lines the scripts print: where the settings came from and what reaches the ranks' communication
# libraries (NCCL between GPUs, gloo for the CPU-side process group).
site_report() {
    local net
    net=$(env | grep -E '^(NCCL|GLOO|TORCH_NCCL)_[A-Z0-9_]*=' | sort | tr '\n' ' ')
    echo "== site settings: $SITE_NOTE; srun options: ${SRUN_ARGS:-none}"
    echo "== network settings passed to the ranks: ${net:-none (NCCL and gloo choose the interfaces)}"
}
