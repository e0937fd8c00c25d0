"""The dry run (``convit-scale plan --dry-run``): the recipe's real training step on simulated GPUs at the job's world
size, in one process on the CPU.

The rooms: ``native`` (the driverless CUDA, a small C++ extension built once per torch release), ``device`` (the
simulated devices: torch.cuda's answers, the fake tensor mode, the fake process group), ``census`` (the dispatch mode
that routes device work to fake tensors and counts host waits, pageable copies and CPU tensors in collectives),
``data`` (the batches the recipe's loader would hand over), ``run`` (set-up, steps, evaluation) and ``report`` (the
figures beside the planner's).
"""
