# Site settings for the Slurm scripts: copy to slurm/site.sh (git ignores it) or name a file with SITE_SCRIPT=...
# slurm/launch.sh and slurm/prep.sh source it first thing in the job's shell, from the repository root.
#
# Partition and account are sbatch's, chosen at submission (a running job cannot change them): pass them on the
# command line (sbatch -p gpu -A myproject slurm/train.sh) or export them where you submit:
#   export SBATCH_PARTITION=gpu SBATCH_ACCOUNT=myproject SBATCH_QOS=normal

# Software: modules, or a virtual environment on the shared filesystem.
# module load cuda/12.4 nccl
# PYTHON=/shared/envs/convit/bin/python         # default: .venv/bin/python, else python3

# Network. Exported variables reach every rank (srun and torchrun pass the environment on). On nodes with several
# interfaces name the one the ranks should use: NCCL for the GPUs' traffic, gloo for the CPU-side process group
# (object collectives, checkpoint coordination).
# export NCCL_SOCKET_IFNAME=ib0 GLOO_SOCKET_IFNAME=ib0
# export NCCL_IB_HCA=mlx5 NCCL_DEBUG=WARN

# A container (enroot/pyxis): extra options for every srun step of the scripts. The steps run PYTHON inside it, the
# checks before training (the recipe, torchrun's options) too, in a one-task step; the batch shell runs only the
# fault bookkeeping between steps (standard library, HOST_PYTHON, default python3 where PYTHON is not on the host):
# the host needs no torch. The image: slurm/container/ (Dockerfile, Apptainer .def; `enroot import` makes the .sqsh).
# SRUN_ARGS="--container-image=/shared/images/convit-scale.sqsh --container-mounts=/data:/data,$PWD:$PWD --container-workdir=$PWD"
# PYTHON=python3                 # the image's; a path that exists only inside the image is kept as given

# Launcher defaults (the environment at submission still wins where these use ${VAR:-...}).
# LAUNCHER=${LAUNCHER:-srun}
# MAX_REQUEUES=${MAX_REQUEUES:-50}
