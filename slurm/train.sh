#!/usr/bin/env bash
# Any recipe on Slurm: Tables 1-4 (the per-model scripts beside this one fix Table 1's and Table 4's node counts),
# Table 2's subsets, Table 3's ablations, or a recipe of your own. Submit from the repository root:
#   RECIPE=recipes/table3/convit_small_plus_b_full.yaml DATA_DIR=/data/imagenet-ffcv sbatch --nodes=2 slurm/train.sh
#   RECIPE=recipes/table2/deit_small_f0.1.yaml DATA_DIR=/data/in-ffcv-10 sbatch slurm/train.sh
# Nodes, GPUs and time from sbatch's command line (defaults below: 1 node x 8 GPUs, 48 h). The run folder is the
# recipe's run.output_dir, so a requeue, a resubmission and `convit-scale train` all continue the same run.
# 48 h is a ceiling for any recipe, not an estimate: the per-model scripts beside this one take 4 x the hours that
# `convit-scale plan` estimates for their job; `convit-scale plan --recipe R --nodes N` prints a recipe's (wall-clock
# h), for sbatch --time. A job that reaches its limit saves and requeues itself (--signal=USR1, --requeue).
# The global batch is the recipe's whatever the node count (micro-batch x accumulation x world).
#SBATCH --job-name=convit-scale
#SBATCH --nodes=1
#SBATCH --ntasks-per-node=8
#SBATCH --gpus-per-node=8
#SBATCH --cpus-per-task=10
#SBATCH --time=48:00:00
#SBATCH --signal=USR1@300
#SBATCH --requeue
#SBATCH --open-mode=append
#SBATCH --output=slurm-%x-%j.out
exec bash "${SLURM_SUBMIT_DIR:-.}/slurm/launch.sh"
