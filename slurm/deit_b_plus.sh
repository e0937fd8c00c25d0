#!/usr/bin/env bash
# recipes/table1/deit_base_plus.yaml on 4 node(s) x 8 GPUs. Submit from the repository root:
#   DATA_DIR=/data/imagenet-ffcv sbatch slurm/deit_b_plus.sh
# The global batch is the recipe's whatever the node count (micro-batch x accumulation x world).
# Time limit: 4 x the 1.8 h that `convit-scale plan --slurm-jobs --gpu h200-141gb` estimates for this job (at
# 40% MFU; evaluation, checkpoints and start-up not counted), rounded up; a job that reaches it saves and
# requeues itself (--signal=USR1, --requeue).
#SBATCH --job-name=deit_b_plus
#SBATCH --nodes=4
#SBATCH --ntasks-per-node=8
#SBATCH --gpus-per-node=8
#SBATCH --cpus-per-task=10
#SBATCH --time=8:00:00
#SBATCH --signal=USR1@300
#SBATCH --requeue
#SBATCH --open-mode=append
#SBATCH --output=slurm-%x-%j.out
RECIPE=${RECIPE:-recipes/table1/deit_base_plus.yaml} exec bash "${SLURM_SUBMIT_DIR:-.}/slurm/launch.sh"
