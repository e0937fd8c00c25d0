"""A dry run: the recipe's own set-up and training step (``train.setup``, ``train.step.train_step``) for a few steps,
then an evaluation, on simulated GPUs at the job's world size in this process (``device.simulated_gpus``), with the
census of what a GPU run would wait for or refuse (``census``) and the peak of the live device tensors per rank
(torch's ``MemTracker`` on the fake tensors).

The peak counts the tensors the step holds at their real shapes and dtypes; it leaves out the CUDA context, NCCL's
buffers, cuBLAS workspaces and the caching allocator's rounding and fragmentation. The fake group computes nothing:
every value a host reads is zero (the step reads a finite loss and norm of 0, so it takes the update path), and the
numerics, NCCL's own refusals and speed are for a GPU to show (``make gpu-test``).
"""

from __future__ import annotations

import dataclasses
import tempfile
from pathlib import Path

import torch
from torch.distributed._tools.mem_tracker import MemTracker

from .. import evaluation
from ..config import Config
from ..train.distributed import init_distributed
from ..train.setup import setup
from ..train.signals import StopSignal
from ..train.step import steps_of_epoch, train_step
from .census import Census, DeviceMismatch
from .data import loaders
from .device import ddp_comm_hook, simulated_gpus

EVAL_BATCHES = 1
"""Evaluation batches per rank after the steps: one forward of the evaluation's shape."""


def dry_run_config(cfg: Config, output_dir: Path) -> Config:
    """The recipe as the dry run trains it: its own model, batch and parallel sections; the run folder a scratch one,
    no TensorBoard or W&B, no progress bar, data paths standing for the synthetic batches."""
    d = cfg.data
    data = dataclasses.replace(d, train_path=d.train_path or "dry-run", val_path=d.val_path or "dry-run")
    log = dataclasses.replace(cfg.log, tensorboard=False, wandb=False, progress=False)
    return dataclasses.replace(cfg, data=data, log=log, run=dataclasses.replace(cfg.run, output_dir=str(output_dir)))


def dry_run(cfg: Config, nodes: int, gpus_per_node: int, steps: int = 3) -> dict:
    """``steps`` training steps and one evaluation of ``cfg`` on ``nodes`` x ``gpus_per_node`` simulated GPUs: the
    census (``census.Census``), the peak live device memory of a rank, and a device mismatch if one stopped it."""
    census, world = Census(), nodes * gpus_per_node
    out = {"world_size": world, "nodes": nodes, "gpus_per_node": gpus_per_node, "steps": steps,
           "strategy": cfg.parallel.strategy, "census": census, "mismatch": None, "peak_bytes": None}
    with tempfile.TemporaryDirectory(prefix="convit-dry-run-") as scratch:
        run_cfg = dry_run_config(cfg, Path(scratch))
        try:
            with simulated_gpus(world, gpus_per_node, census):
                out["peak_bytes"] = _train_and_evaluate(run_cfg, steps, census)
        except DeviceMismatch as e:
            out["mismatch"] = str(e)
    return out


def _train_and_evaluate(cfg: Config, steps: int, census: Census) -> int:
    """The run's own set-up, ``steps`` steps and one evaluation; returns the peak live bytes on cuda:0."""
    ctx = init_distributed("nccl")  # the group exists: this rank's device, as a GPU run chooses it
    stop = StopSignal()
    tracker = MemTracker()
    try:
        with tracker:
            run, state = setup(cfg, ctx, stop, build=loaders(cfg.model.num_classes, steps, EVAL_BATCHES))
            try:
                if isinstance(run.strategy.wrapped, torch.nn.parallel.DistributedDataParallel):
                    run.strategy.wrapped.register_comm_hook(None, ddp_comm_hook)
                run.strategy.forward = _tracked_forward(run.strategy.forward, tracker)
                for micro_batches in steps_of_epoch(run, state):
                    census.phase = f"step {state.step + 1}"
                    _count_in_its_step(micro_batches.images, census, state)
                    train_step(run, state, micro_batches)
                census.phase = "eval"
                run.strategy.train(False)
                evaluation.evaluate(run.strategy.forward, run.val_loader, ctx.device)
                run.strategy.train(True)
            finally:
                census.phase = "teardown"
                run.metrics.close()
                run.strategy.close()
    finally:
        stop.restore()
    peak = tracker.get_tracker_snapshot("peak")
    return max((snap.get("Total", 0) for dev, snap in peak.items() if torch.device(dev).type == "cuda"), default=0)


def _count_in_its_step(images, census: Census, state) -> None:
    """The next step's first micro-batch, made on the device during this step (``StepImages.prepare``), counted as
    that step's: each measured step holds its whole data path, the first step its own. Wrapped once per epoch."""
    if getattr(images.prepare, "counted_in_its_step", False):
        return
    prepare = images.prepare

    def in_its_step(batch, *args):
        before, census.phase = census.phase, f"step {state.step + 2}"
        try:
            prepare(batch, *args)
        finally:
            census.phase = before

    in_its_step.counted_in_its_step = True
    images.prepare = in_its_step


def _tracked_forward(forward, tracker: MemTracker):
    """``forward`` with the tracker's per-module figures reset before each call (the peak is kept): MemTracker follows
    one forward of the model per reset, and a step of several micro-batches (``data.micro_batch_size``, which
    ``plan`` advises where a batch does not fit) makes one each."""

    def tracked(*args, **kwargs):
        tracker.reset_mod_stats()
        return forward(*args, **kwargs)

    return tracked
