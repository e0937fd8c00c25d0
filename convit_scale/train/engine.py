"""The training loop: one loop for DDP, FSDP2 and DeepSpeed ZeRO, with exact resume.

A run, in order: ``setup`` (process group -> global batch -> loaders -> model -> strategy -> loss -> resume),
then epochs of ``train_step`` (micro-batches, one packed reduction, the non-finite policy), ``log_step`` (host
values only at log steps), periodic ``save``, ``end_of_epoch`` (evaluation, analysis, checkpoint), and a final
evaluation and checkpoint. A stop signal makes every rank finish its step and save; ``train`` then returns
``"stopped"`` and ``main`` exits with ``EXIT_REQUEUE``: the library never exits the process.
"""

from __future__ import annotations

import contextlib
import itertools
import math
import os
import signal
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from timm.loss import SoftTargetCrossEntropy

from ..config import Config, model_options
from ..data import DataError, LoaderSpec, build_loader
from ..data.device_augment import DeviceAugmentConfig, augment_batch, augment_on_device, normalize
from ..data.device_augment import config_of as device_augment_config
from ..data.order import step_seed
from ..data.transforms import build_mixup, seed_all
from ..metrics import MetricsWriter, wandb_options
from ..models import MODELS, create_model, load_pretrained
from ..models.weights import CheckpointMismatch, check_state_dict, convert_state_dict, read_state_dict
from ..parallel import build_strategy, preload
from .. import comm, evaluation
from .checkpoint import check_compatible, choose_checkpoint, load_checkpoint, read_meta, save_checkpoint
from ..analysis.during_training import epoch_analysis
from .debug import Faults, checksum, state_digest
from .distill import DistillLoss, check_teacher, load_teacher
from .distributed import DistContext, check_world, init_distributed
from .memory import peak_memory_mb, reset_peak_memory, tensor_memory_mb
from .optim import build_optimizer
from .schedule import lr_at, peak_lr
from .state import TrainState

EXIT_REQUEUE = 75
"""Exit status of a run stopped by SIGUSR1/SIGTERM after saving: the Slurm scripts requeue on it."""


class NonFiniteLoss(RuntimeError):
    pass


class SetupRefused(RuntimeError):
    """The run cannot start as configured (data, checkpoint, world size): a one-line reason, nothing trained."""


class StopSignal:
    """Set by SIGUSR1 / SIGTERM (Slurm's pre-timeout signal, preemption, scancel); read once per step, inside
    the step's one reduction, so that every rank stops after the same step."""

    def __init__(self):
        self.signum: int | None = None
        for s in (signal.SIGUSR1, signal.SIGTERM):
            signal.signal(s, self._handler)

    def _handler(self, signum, frame):
        self.signum = signum

    @property
    def requested(self) -> bool:
        return self.signum is not None


@dataclass
class Run:
    """Everything set up once: the loop reads it, ``TrainState`` is what changes."""

    cfg: Config
    ctx: DistContext
    out: Path
    micro: int
    accum: int
    lr: float
    steps_per_epoch: int
    total_steps: int
    train_loader: object
    val_loader: object | None
    strategy: object
    criterion: object
    mixup: object | None
    metrics: MetricsWriter
    stop: StopSignal
    faults: Faults | None = None
    teacher: torch.nn.Module | None = None
    memory: dict = field(default_factory=dict)  # base / set-up peak / model state, MB
    device_augment: DeviceAugmentConfig | None = None  # set: train batches are uint8 crops, augmented on the device
    final: dict = field(default_factory=dict)
    clock: list = field(default_factory=lambda: [time.time(), 0])  # last log time, images since

    @property
    def checkpoints(self) -> Path:
        return self.out / "checkpoints"


@dataclass
class StepResult:
    loss: torch.Tensor  # mean over micro-batches and ranks, still on the device
    grad_norm: float | None
    bad: bool
    stop: bool
    lr: float
    bad_samples: list = field(default_factory=list)  # every rank's replaced samples of the step (Batch.bad)


# -- set-up ----------------------------------------------------------------------------------------------------
def build_model(cfg: Config, meta: bool = False):
    torch.manual_seed(cfg.run.seed)  # the same initial weights on every rank and world size
    model = create_model(cfg.model.name, device="meta" if meta else None, **model_options(cfg.model))
    if cfg.model.pretrained and meta:  # checked now, loaded into the shards after sharding
        check_state_dict(convert_state_dict(read_state_dict(cfg.model.pretrained), model), model, cfg.model.pretrained)
    elif cfg.model.pretrained:
        load_pretrained(model, cfg.model.pretrained)
    return model


def _loss_fn(cfg: Config):
    if cfg.data.mixup > 0 or cfg.data.cutmix > 0:
        return SoftTargetCrossEntropy()  # targets from Mixup already carry the label smoothing
    return lambda logits, y: F.cross_entropy(logits, y, label_smoothing=cfg.data.label_smoothing)


def _criterion(cfg: Config, device: torch.device):
    """(criterion(x, logits, target), teacher or None)."""
    if not cfg.distill.enabled:
        base_loss = _loss_fn(cfg)
        return (lambda x, logits, y: base_loss(logits, y)), None
    teacher = load_teacher(cfg, device)
    return DistillLoss(_loss_fn(cfg), teacher, cfg.distill, precision=cfg.parallel.precision), teacher


def _loaders(cfg: Config, ctx: DistContext, micro: int):
    img_size = cfg.model.img_size or MODELS[cfg.model.name].img_size
    pin, on_device = ctx.device.type == "cuda", augment_on_device(cfg.data, ctx.device)
    train_loader = build_loader(cfg.data, LoaderSpec("train", img_size, micro, ctx.world_size, ctx.rank, cfg.run.seed,
                                                     pin_memory=pin, augment_on_device=on_device))
    val_loader = build_loader(cfg.data, LoaderSpec("val", img_size, cfg.data.eval_batch_size, ctx.world_size, ctx.rank,
                                                   cfg.run.seed, pin_memory=pin, augment_on_device=on_device)
                              ) if cfg.data.val_path else None
    return train_loader, val_loader


def _strategy(cfg: Config, ctx: DistContext, micro: int, accum: int, lr: float):
    preload(cfg.parallel.strategy)  # library code belongs to the baseline, not to the model's memory
    base_mem = round(peak_memory_mb(ctx.device), 1)  # before the model: what the process costs without it
    model = build_model(cfg, meta=cfg.parallel.meta_init)
    strategy = build_strategy(model, cfg.parallel, ctx.device, ctx.world_size, cfg.optim.grad_clip)
    strategy.setup(lambda m: build_optimizer(m, cfg.optim, lr), micro, accum)
    if cfg.parallel.meta_init and cfg.model.pretrained:
        strategy.load_full_state_dict(convert_state_dict(read_state_dict(cfg.model.pretrained), strategy.module))
    return strategy, base_mem


def _resume_point(cfg: Config, out: Path) -> tuple[Path | None, dict | None]:
    """The checkpoint to resume from (rank 0 chooses, every rank gets the same) and its meta, checked against
    the recipe before anything is written into the run folder."""
    path = choose_checkpoint(out / "checkpoints", cfg.checkpoint.resume)
    if path is None:
        return None, None
    meta = read_meta(path)
    check_compatible(path, meta, {"strategy": cfg.parallel.strategy, "model": cfg.model.name,
                                  "global_batch_size": cfg.data.global_batch_size, "world_size": comm.world_size()})
    return path, meta


def setup(cfg: Config, ctx: DistContext, stop: StopSignal) -> tuple[Run, TrainState]:
    out = Path(cfg.run.output_dir)
    micro, accum = check_world(cfg, ctx.world_size)
    lr = peak_lr(cfg.optim.base_lr, cfg.data.global_batch_size, cfg.optim.lr_reference_batch)
    ckpt, meta = _resume_point(cfg, out)
    if ctx.is_main:
        out.mkdir(parents=True, exist_ok=True)
        (out / "config.yaml").write_text(cfg.to_yaml())
        (out / "STOPPED_FOR_REQUEUE").unlink(missing_ok=True)
    _log(ctx, f"[convit-scale] {cfg.model.name} | strategy {cfg.parallel.strategy} | {ctx.world_size} rank(s) on "
              f"{ctx.device.type} ({ctx.backend}, launched by {ctx.launcher}) | global batch "
              f"{cfg.data.global_batch_size} = micro {micro} x accumulation {accum} x world {ctx.world_size} | "
              f"lr {lr:.3g} = {cfg.optim.base_lr:g} x {cfg.data.global_batch_size}/{cfg.optim.lr_reference_batch}")
    train_loader, val_loader = _loaders(cfg, ctx, micro)
    steps_per_epoch = len(train_loader) // accum
    if steps_per_epoch == 0:
        raise DataError(f"{train_loader.num_samples} training images give no full global batch of "
                        f"{cfg.data.global_batch_size} per epoch")
    total_steps = cfg.schedule.epochs * steps_per_epoch
    if cfg.schedule.max_steps is not None:
        total_steps = min(total_steps, cfg.schedule.max_steps)
    strategy, base_mem = _strategy(cfg, ctx, micro, accum, lr)
    criterion, teacher = _criterion(cfg, ctx.device)
    state = TrainState()
    if ckpt is not None:
        state = TrainState.from_meta(load_checkpoint(ckpt, strategy), accum, ctx.world_size)
        _log(ctx, f"[convit-scale] resumed from {ckpt} at step {state.step} (epoch {state.epoch}, "
                  f"batch {state.batch_in_epoch})")
    run = Run(cfg, ctx, out, micro, accum, lr, steps_per_epoch, total_steps, train_loader, val_loader, strategy,
              criterion, build_mixup(cfg.data, cfg.model.num_classes),
              MetricsWriter(out, ctx.is_main, cfg.log.tensorboard, start_step=state.step,
                            wandb=wandb_options(cfg.log, cfg.run.output_dir, cfg.to_dict())), stop,
              faults=Faults.from_env(ctx.rank), teacher=teacher,
              device_augment=device_augment_config(cfg.data) if train_loader.spec.augment_on_device else None)
    if teacher is not None:
        check_teacher(teacher, cfg, val_loader, ctx)
    run.memory = {"base_mem_mb": base_mem, "setup_peak_mem_mb": round(peak_memory_mb(ctx.device), 1),
                  "state_mem_mb": None}
    reset_peak_memory(ctx.device)
    if teacher is not None and cfg.log.debug_digest:
        run.memory["teacher_checksum_start"] = checksum(teacher)
    return run, state


def _closing_iter(iterable):
    """A generator over ``iterable`` that closes the loader's epoch when it is closed itself."""
    it = iter(iterable)
    try:
        yield from it
    finally:
        close = getattr(it, "close", None)
        if close is not None:
            close()


# -- one step --------------------------------------------------------------------------------------------------
def steps_of_epoch(run: Run, state: TrainState):
    """The micro-batches of each remaining step of the current epoch, one step at a time; the loader's epoch is
    closed when the epoch ends or the loop leaves it early."""
    with contextlib.closing(_closing_iter(run.train_loader.epoch(state.epoch, start_batch=state.batch_in_epoch))) as it:
        while state.batch_in_epoch // run.accum < run.steps_per_epoch and state.step < run.total_steps:
            yield itertools.islice(it, run.accum)


def train_step(run: Run, state: TrainState, micro_batches) -> StepResult:
    """Forward/backward over the step's micro-batches, then one packed all-reduce of (loss sum, non-finite loss,
    non-finite gradient norm, stop, replaced samples) read by the host once: a bad step is skipped on every rank
    alike, and the replaced samples are gathered only when some rank has any."""
    cfg, ctx, strategy = run.cfg, run.ctx, run.strategy
    seed_all(step_seed(cfg.run.seed, state.epoch, state.step, ctx.rank))  # Mixup, drop-path
    lr = lr_at(state.step, run.lr, run.steps_per_epoch, cfg.schedule)
    strategy.set_lr(lr)
    stats = torch.zeros(5, dtype=torch.float64, device=ctx.device)
    bad_samples: list[dict] = []
    micro_batches = _listing_bad(micro_batches, bad_samples)
    m = -1
    for m, batch in enumerate(micro_batches):
        with strategy.micro_batch(is_last_micro=m == run.accum - 1):
            _micro_step(run, state, batch, m, stats)
        state.batch_in_epoch += 1
    if m + 1 != run.accum:
        raise DataError(f"the training loader ended {run.accum - m - 1} micro-batch(es) early in epoch {state.epoch} "
                        f"(batch {state.batch_in_epoch} of {len(run.train_loader)})")
    if cfg.log.debug_memory and run.memory["state_mem_mb"] is None and state.step > 0:
        # once, with gradients accumulated and the optimizer moments in place (a step was taken)
        run.memory["state_mem_mb"] = comm.all_gather_object(round(tensor_memory_mb(ctx.device, strategy.module), 1))
    norm = strategy.clip_gradients()
    if not strategy.scales_loss:  # with a loss scaler an overflow is its business, not a bad step
        stats[2] += (~torch.isfinite(norm)).double()
    stats[3].fill_(float(run.stop.requested))
    stats[4].fill_(float(len(bad_samples)))  # gathered below only when some rank has any
    stats = comm.all_reduce(stats)
    bad_loss, bad_norm, stop, num_bad, grad_norm = torch.cat([stats[1:], norm.reshape(1).double()]).tolist()
    if num_bad:
        bad_samples = [{**r, "rank": rank} for rank, rs in enumerate(comm.all_gather_object(bad_samples)) for r in rs]
    if bad_loss or bad_norm:
        _bad_step(run, state, "loss" if bad_loss else "gradient norm")
    else:
        strategy.step()
        state.consecutive_bad = 0
    state.step += 1
    bad = bool(bad_loss or bad_norm)
    return StepResult(stats[0] / (run.accum * ctx.world_size), None if bad or not math.isfinite(grad_norm) else grad_norm,
                      bad, stop > 0, lr, bad_samples)


def _micro_step(run: Run, state: TrainState, batch, m: int, stats: torch.Tensor) -> None:
    """Forward and backward of micro-batch ``m``; its loss and non-finite flag are added to ``stats`` on the device."""
    ctx = run.ctx
    x, y = batch
    x, y = x.to(ctx.device, non_blocking=True), y.to(ctx.device, non_blocking=True)
    if run.device_augment is not None:  # RandAugment, normalisation, erasing; every draw from the sample seed
        x = augment_batch(x, batch.seeds, run.device_augment)
    target = y
    if run.mixup is not None:
        x, target = run.mixup(x, y)
    out = run.strategy.forward(x)  # a (class, distillation) pair with a distillation token
    logits = tuple(o.float() for o in out) if isinstance(out, tuple) else out.float()
    loss = run.criterion(x, logits, target)
    if run.faults is not None:
        loss = run.faults.apply(loss, state.step, m)
    stats[0] += loss.detach()
    stats[1] += (~torch.isfinite(loss.detach())).double()
    run.strategy.backward(loss, is_last_micro=m == run.accum - 1, grad_accum=run.accum)


def _listing_bad(micro_batches, into: list):
    """The micro-batches, unchanged; the samples each loader replaced (``Batch.bad``) are appended to ``into``."""
    for batch in micro_batches:
        into.extend(getattr(batch, "bad", ()))
        yield batch


def _bad_step(run: Run, state: TrainState, what: str) -> None:
    if run.cfg.run.nonfinite_policy == "stop":
        raise NonFiniteLoss(f"non-finite {what} at step {state.step} (epoch {state.epoch}); stopped without "
                            f"saving (run.nonfinite_policy = 'stop'); the last checkpoint is intact")
    run.strategy.skip_step()
    state.skipped_steps += 1
    state.consecutive_bad += 1
    if state.consecutive_bad > run.cfg.run.max_skipped_steps:
        raise NonFiniteLoss(f"{state.consecutive_bad} consecutive non-finite steps (run.max_skipped_steps = "
                            f"{run.cfg.run.max_skipped_steps}); stopped without saving")


def log_step(run: Run, state: TrainState, res: StepResult, progress, task) -> None:
    """metrics.jsonl at log steps: the only place where the loss reaches the host."""
    cfg = run.cfg
    run.clock[1] += cfg.data.global_batch_size
    for record in res.bad_samples:  # every step that has any: one record per replaced sample
        run.metrics.write({"kind": "bad_sample", "step": state.step, "epoch": state.epoch, **record})
    if state.step % cfg.log.every_steps == 0 or state.step == run.total_steps:
        now = time.time()
        loss = None if res.bad else res.loss.item()
        rec = {"kind": "train", "step": state.step, "epoch": state.epoch, "loss": loss, "lr": res.lr,
               "images_per_s": run.clock[1] / max(now - run.clock[0], 1e-9), "grad_norm": res.grad_norm,
               "peak_mem_mb": comm.all_gather_object(round(peak_memory_mb(run.ctx.device), 1)),
               "base_mem_mb": run.memory["base_mem_mb"], "setup_peak_mem_mb": run.memory["setup_peak_mem_mb"],
               "skipped_steps": state.skipped_steps, "state_mem_mb": run.memory["state_mem_mb"]}
        run.metrics.write(rec)
        run.clock[:] = [now, 0]
        progress.update(task, info=f"loss {loss if loss is None else round(loss, 4)} lr {res.lr:.2e} "
                                   f"{rec['images_per_s']:.0f} img/s")
    if cfg.log.debug_digest:
        digests = comm.all_gather_object(state_digest(run.strategy.optimizer_tensors()))
        run.metrics.write({"kind": "digest", "step": state.step, "bad": res.bad, "state_digest": digests})
    progress.update(task, completed=state.step)


# -- evaluation, analysis, checkpoints -------------------------------------------------------------------------
def evaluate(strategy, loader, ctx: DistContext, max_batches: int | None = None) -> dict:
    strategy.train(False)
    try:
        return evaluation.evaluate(strategy.forward, loader, ctx.device, max_batches)
    finally:
        strategy.train(True)


def end_of_epoch(run: Run, state: TrainState, epoch: int) -> None:
    """Evaluation and the gating/nonlocality analysis, every ``run.eval_every_epochs`` and at the end (a short
    epoch, as on a small Table 2 subset, would otherwise spend more on its analysis than on its steps)."""
    cfg, results = run.cfg, {}
    if run.val_loader is not None and ((epoch + 1) % cfg.run.eval_every_epochs == 0 or state.step >= run.total_steps):
        results = evaluate(run.strategy, run.val_loader, run.ctx)
        results = state.record_eval(epoch, results)  # final and best top-1/top-5
        run.metrics.write({"kind": "eval", "step": state.step, "epoch": epoch, **results})
        _log(run.ctx, f"[convit-scale] epoch {epoch} step {state.step}: top-1 {results['top1']:.2f} "
                      f"top-5 {results['top5']:.2f} ({results['samples']} images); best top-1 "
                      f"{results['best_top1']:.2f} (epoch {results['best_epoch']})")
        stats = epoch_analysis(run.strategy, run.cfg, run.val_loader, run.ctx)
        if stats is not None:
            run.metrics.write({"kind": "analysis", "step": state.step, "epoch": epoch, **stats})
    run.final.update(results)


def save(run: Run, state: TrainState, reason: str) -> Path:
    cfg = run.cfg
    meta = {**state.to_meta(run.accum, run.ctx.world_size), "reason": reason, "strategy": cfg.parallel.strategy,
            "model": cfg.model.name, "global_batch_size": cfg.data.global_batch_size, "config": cfg.to_dict(),
            "time": time.time()}
    return save_checkpoint(run.checkpoints, run.strategy, meta, cfg.checkpoint.keep_last)


def save_and_stop(run: Run, state: TrainState) -> str:
    path = save(run, state, "signal")
    _log(run.ctx, f"[convit-scale] stop signal: saved {path}; exiting with {EXIT_REQUEUE} to be requeued")
    run.metrics.write({"kind": "stopped", "step": state.step, "epoch": state.epoch, "checkpoint": str(path)})
    if run.ctx.is_main:  # for launchers (torchrun) that do not pass the exit status through
        (run.out / "STOPPED_FOR_REQUEUE").write_text(str(path))
    comm.barrier()
    return "stopped"


def _periodic_save(run: Run, state: TrainState, every: int | None, count: int, reason: str) -> None:
    """A periodic checkpoint, never from a state that followed a bad step without a good one after it."""
    if every and count % every == 0 and state.step < run.total_steps and state.consecutive_bad == 0:
        save(run, state, reason)


# -- the loop --------------------------------------------------------------------------------------------------
def _progress(enabled: bool):
    from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn

    return Progress(TextColumn("[bold]{task.description}"), BarColumn(), TextColumn("{task.completed}/{task.total}"),
                    TextColumn("{task.fields[info]}"), TimeElapsedColumn(), TimeRemainingColumn(),
                    disable=not enabled, transient=False)


def fit(run: Run, state: TrainState) -> str:
    """Epochs of steps until ``total_steps``; returns "finished", or "stopped" after a stop signal and a save."""
    cfg = run.cfg
    run.strategy.train(True)
    with _progress(run.ctx.is_main and cfg.log.progress) as progress:
        task = progress.add_task("train", total=run.total_steps, completed=state.step, info="")
        while state.step < run.total_steps:
            if state.batch_in_epoch // run.accum >= run.steps_per_epoch:
                # saved after the epoch's last step but before its evaluation (a stop signal, an every_steps
                # checkpoint): evaluate it now; an epoch checkpoint is saved after its evaluation, at the next epoch
                end_of_epoch(run, state, state.epoch)
                state.epoch, state.batch_in_epoch = state.epoch + 1, 0
                _periodic_save(run, state, cfg.checkpoint.every_epochs, state.epoch, "epoch")
                continue
            for micro_batches in steps_of_epoch(run, state):
                res = train_step(run, state, micro_batches)
                log_step(run, state, res, progress, task)
                if res.stop:
                    return save_and_stop(run, state)
                _periodic_save(run, state, cfg.checkpoint.every_steps, state.step, "every_steps")
            if state.batch_in_epoch // run.accum >= run.steps_per_epoch:  # a whole epoch
                end_of_epoch(run, state, state.epoch)
                state.epoch, state.batch_in_epoch = state.epoch + 1, 0
                _periodic_save(run, state, cfg.checkpoint.every_epochs, state.epoch, "epoch")
        if not run.final and run.val_loader is not None:  # max_steps ended mid-epoch: evaluate the end
            end_of_epoch(run, state, state.epoch if state.batch_in_epoch else state.epoch - 1)
    path = save(run, state, "end")
    run.final.update(step=state.step, skipped_steps=state.skipped_steps, checkpoint=str(path))
    if run.teacher is not None and cfg.log.debug_digest:  # the teacher never trains: same weights as loaded
        run.metrics.write({"kind": "distill", "step": state.step,
                           "teacher_checksum_start": run.memory["teacher_checksum_start"],
                           "teacher_checksum_end": checksum(run.teacher), "teacher_in_optimizer": any(
                               p is q for g in run.strategy.optimizer.param_groups for p in g["params"]
                               for q in run.teacher.parameters())})
    run.metrics.write({"kind": "end", **run.final})
    return "finished"


def train(cfg: Config) -> str:
    """Run the recipe on this rank; returns "finished" or "stopped" (after a stop signal, saved)."""
    stop = StopSignal()
    ctx = init_distributed(cfg.parallel.backend, cfg.parallel.timeout_s)
    try:
        try:
            run, state = setup(cfg, ctx, stop)
        except (DataError, FileNotFoundError, CheckpointMismatch, ValueError) as e:
            raise SetupRefused(str(e)) from e
        try:
            return fit(run, state)
        finally:
            run.metrics.close()
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
        if ctx.launcher == "alone":  # the one-process group's variables must not leak into a next run
            for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
                os.environ.pop(key, None)


def _log(ctx: DistContext, msg: str) -> None:
    if ctx.is_main:
        print(msg, flush=True)


__all__ = ["train", "fit", "setup", "train_step", "evaluate", "build_model", "EXIT_REQUEUE", "NonFiniteLoss", "SetupRefused"]
