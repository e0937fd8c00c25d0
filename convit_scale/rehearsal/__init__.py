"""Rehearsing a Slurm job at its real rank count on one machine: a local Slurm cluster (``cluster.py``: munged,
slurmctld and several slurmd on loopback) and the rehearsal of a multi-node job script through a preemption,
requeue and resume (``run.py``; ``python -m convit_scale.rehearsal``, ``make rehearsal``). The tests start the same
cluster for the scripts of slurm/."""
