"""Set-up of one rank's run, in order: global batch -> resume point (checked before anything is written) ->
loaders -> model -> strategy -> loss (and teacher) -> resume -> ``Run``, which the loop only reads."""

from __future__ import annotations

import gc
from dataclasses import dataclass, field
from pathlib import Path

import torch

from .. import comm, jpeg_roi
from ..cadence import advice_line, every_minutes_of
from ..config import Config, model_options, shares_note
from ..data import DataError, Loader, LoaderSpec, build_loader
from ..data.device_augment import DeviceAugmentConfig, augment_on_device, handover_of
from ..data.device_augment import config_of as device_augment_config
from ..data.mixup import GroupMixup
from ..files import write_atomic
from ..metrics import MetricsWriter, wandb_options
from ..models import MODELS, create_model, load_pretrained
from ..models.weights import check_state_dict, convert_state_dict, read_state_dict
from ..parallel import Strategy, build_strategy, preload
from ..runfolder import STOPPED_FOR_REQUEUE, FolderHeld, check_lease, checkpoints, describe_holder, write_lease
from .checkpoint import check_compatible, choose_checkpoint, load_checkpoint, read_meta
from .debug import Faults, checksum
from .distill import check_teacher
from .distributed import DistContext, check_world
from .loss import Criterion, build_criterion
from .memory import peak_memory_mb, reset_peak_memory
from .optim import build_optimizer
from .schedule import peak_lr
from .signals import StopSignal
from .state import TrainState
from .watchdog import DeviceProgress, Watchdog


@dataclass(frozen=True)
class Run:
    """Everything set up once; the loop reads it and never changes it (``TrainState`` is what changes)."""

    cfg: Config
    ctx: DistContext
    out: Path
    micro: int
    """Images per rank per forward."""
    accum: int
    """Micro-batches per optimizer step."""
    lr: float
    """The peak learning rate (base_lr scaled by the global batch)."""
    steps_per_epoch: int
    total_steps: int
    train_loader: Loader
    val_loader: Loader | None
    strategy: Strategy
    criterion: Criterion
    """(images, logits, targets) -> loss (loss.py); the images feed a distillation teacher."""
    mixup: GroupMixup | None
    """Mixup/CutMix per canonical group (None when both are off)."""
    metrics: MetricsWriter
    stop: StopSignal
    faults: Faults | None = None
    teacher: torch.nn.Module | None = None
    device_augment: DeviceAugmentConfig | None = None
    """Set: train batches are uint8 crops, augmented on the device from each sample's seed."""
    watch: Watchdog | None = None
    """This rank's watchdog (watchdog.py): the loop marks its phases in it."""
    every_minutes: float | None = None
    """checkpoint.every_minutes, resolved ('auto': cadence.every_minutes_of)."""
    device_bad: dict = field(default_factory=dict)
    """Epoch -> the views no decoder read in the training device's decode (every rank's), against
    data.max_bad_samples (the loaders count their own)."""
    said: set = field(default_factory=set)
    """What the run's console has said once (``say_once``)."""

    @property
    def checkpoints(self) -> Path:
        return checkpoints(self.out)


def build_model(cfg: Config, meta: bool = False):
    """The model of the recipe (published weights loaded, or checked now and loaded into the shards after sharding
    when built on the meta device). Built whole, its initial weights are the same on every rank and world size
    (seeded here). With ``parallel.meta_init`` each rank initialises its own shards after sharding (FSDP2's
    DTensors draw from each rank's generator, or on CUDA from DTensor's random-number tracker), so the initial
    weights depend on the world size and device: the same seed gives the same run only on the same layout."""
    torch.manual_seed(cfg.run.seed)
    model = create_model(cfg.model.name, device="meta" if meta else None, **model_options(cfg.model))
    if cfg.model.pretrained and meta:
        check_state_dict(convert_state_dict(read_state_dict(cfg.model.pretrained), model), model, cfg.model.pretrained)
    elif cfg.model.pretrained:
        load_pretrained(model, cfg.model.pretrained)
    return model


def _mixup(cfg: Config) -> GroupMixup | None:
    d = cfg.data
    if d.mixup <= 0 and d.cutmix <= 0:
        return None
    return GroupMixup(d, cfg.model.num_classes, d.global_batch_size // d.groups, d.groups, cfg.run.seed)


def _loaders(cfg: Config, ctx: DistContext, micro: int, build=build_loader) -> tuple[Loader, Loader | None]:
    img_size = cfg.model.img_size or MODELS[cfg.model.name].img_size
    pin, on_device = ctx.device.type == "cuda", augment_on_device(cfg.data, ctx.device)
    handover = handover_of(cfg.data, ctx.device)

    def spec(split: str, batch: int) -> LoaderSpec:
        return LoaderSpec(split, img_size, batch, ctx.world_size, ctx.rank, cfg.run.seed, pin_memory=pin,
                          augment_on_device=on_device, handover=handover if split == "train" else "pixels",
                          global_batch_size=cfg.data.global_batch_size, canonical_groups=cfg.data.groups)

    train_loader = build(cfg.data, spec("train", micro))
    val_loader = build(cfg.data, spec("val", cfg.data.eval_batch_size)) if cfg.data.val_path else None
    return train_loader, val_loader


def _strategy(cfg: Config, ctx: DistContext, micro: int, accum: int, lr: float) -> tuple[Strategy, float]:
    preload(cfg.parallel.strategy)  # library code belongs to the baseline, not to the model's memory
    gc.collect()  # an earlier run's garbage in this process (a library caller's, a sweep's) is not this run's
    reset_peak_memory(ctx.device)  # the peak from now: set-up's, above what the process holds now
    base_mem = round(peak_memory_mb(ctx.device), 1)  # before the model: what the process costs without it
    model = build_model(cfg, meta=cfg.parallel.meta_init)
    strategy = build_strategy(model, cfg.parallel, ctx.device, ctx.world_size, cfg.optim.grad_clip)
    strategy.setup(lambda m: build_optimizer(m, cfg.optim, lr, ctx.device), micro, accum)
    if cfg.parallel.meta_init and cfg.model.pretrained:
        strategy.load_full_state_dict(convert_state_dict(read_state_dict(cfg.model.pretrained), strategy.module))
    return strategy, base_mem


def take_lease(cfg: Config, ctx: DistContext, out: Path) -> None:
    """Rank 0 takes the run folder's lease (runfolder.py) before any rank trains: a folder another training holds
    is refused on every rank in one line naming the holder; a stale lease, or one of an earlier start of the same
    Slurm job, is taken over and the takeover logged."""
    decision = None
    if ctx.is_main:
        try:
            verdict, lease, why = check_lease(out, cfg.fault.hang_timeout_s)
            out.mkdir(parents=True, exist_ok=True)
            write_lease(out)
            decision = (None, f"took over the lease of run.output_dir {out} from {describe_holder(lease)}: {why}"
                        if verdict == "take over" else None)
        except FolderHeld as e:
            decision = (str(e), None)
    refusal, note = comm.broadcast_object(decision)
    if refusal:
        raise FolderHeld(refusal)
    if note:
        log(ctx, note)


def _resume_point(cfg: Config, ctx: DistContext, out: Path) -> tuple[Path | None, str]:
    """The checkpoint to resume from and why (rank 0 chooses, every rank gets the same), checked against the recipe
    before anything is written into the run folder."""
    world_size = ctx.world_size
    path, why = choose_checkpoint(checkpoints(out), cfg.checkpoint.resume, lambda msg: log(ctx, msg))
    if path is not None:
        check_compatible(path, read_meta(path), cfg.to_dict(), world_size)
    return path, why


def _schedule_length(cfg: Config, train_loader: Loader, accum: int) -> tuple[int, int]:
    """(optimizer steps per epoch, total steps of the run)."""
    steps_per_epoch = len(train_loader) // accum
    if steps_per_epoch == 0:
        raise DataError(f"{train_loader.num_samples} training images give no full global batch of "
                        f"{cfg.data.global_batch_size} per epoch")
    total_steps = cfg.schedule.epochs * steps_per_epoch
    if cfg.schedule.max_steps is not None:
        total_steps = min(total_steps, cfg.schedule.max_steps)
    return steps_per_epoch, total_steps


def write_resolved(cfg: Config) -> Path:
    """The resolved config in the run folder (``config.yaml``), published atomically: written by a launching process
    for the ranks it starts to load (``launch.run_recipe``), and by rank 0's set-up."""
    out = Path(cfg.run.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    return write_atomic(out / "config.yaml", cfg.to_yaml())


def setup(cfg: Config, ctx: DistContext, stop: StopSignal, watch: Watchdog | None = None,
          build=build_loader) -> tuple[Run, TrainState]:
    """``build``: (data config, LoaderSpec) -> the loader of a split (the dry run's batches in place of the data's)."""
    out = Path(cfg.run.output_dir)
    micro, accum = check_world(cfg, ctx.world_size)
    lr = peak_lr(cfg.optim.base_lr, cfg.data.global_batch_size, cfg.optim.lr_reference_batch)
    take_lease(cfg, ctx, out)
    ckpt, why = _resume_point(cfg, ctx, out)
    if ctx.is_main:
        write_resolved(cfg)
        (out / STOPPED_FOR_REQUEUE).unlink(missing_ok=True)
    note = shares_note(cfg.data.groups, ctx.world_size)
    split = (f"micro {micro} x accumulation {accum} x world {ctx.world_size}" if note is None else
             f"accumulation {accum} of micro-batches up to {micro} on {ctx.world_size} unequal ranks")
    log(ctx, f"{cfg.model.name} | strategy {cfg.parallel.strategy} | {ctx.world_size} rank(s) on {ctx.device.type} "
             f"({ctx.backend}, launched by {ctx.launcher}) | global batch {cfg.data.global_batch_size} = {split} | "
             f"lr {lr:.3g} = {cfg.optim.base_lr:g} x {cfg.data.global_batch_size}/{cfg.optim.lr_reference_batch}")
    if note:  # every rank runs `accum` micro-batches; the loss is weighted by the samples each holds (step.py)
        log(ctx, note)
    train_loader, val_loader = _loaders(cfg, ctx, micro, build)
    steps_per_epoch, total_steps = _schedule_length(cfg, train_loader, accum)
    strategy, base_mem = _strategy(cfg, ctx, micro, accum, lr)
    if strategy.layout_note:
        log(ctx, strategy.layout_note)
    criterion, teacher = build_criterion(cfg, ctx.device)
    state = TrainState()
    if ckpt is not None:
        meta = load_checkpoint(ckpt, strategy)
        state = TrainState.from_meta(meta, accum, ctx.world_size)
        log(ctx, f"resumed from {ckpt} at step {state.step} (epoch {state.epoch}, batch {state.batch_in_epoch}; "
                 f"{why}): resumed step {state.step} from {meta['world_size']} rank(s) on {ctx.world_size}")
    elif cfg.model.pretrained:  # a resumed run's weights are its checkpoint's
        log(ctx, f"model.pretrained: {cfg.model.name} starts from the weights of {cfg.model.pretrained}")
    on_device = train_loader.spec.augment_on_device
    run = Run(cfg, ctx, out, micro, accum, lr, steps_per_epoch, total_steps, train_loader, val_loader, strategy,
              criterion, _mixup(cfg),
              MetricsWriter(out, ctx.is_main, cfg.log.tensorboard, start_step=state.step,
                            wandb=wandb_options(cfg.log, cfg.run.output_dir, cfg.to_dict())), stop,
              faults=Faults.from_env(ctx.rank), teacher=teacher,
              device_augment=device_augment_config(cfg.data) if on_device else None,
              watch=watch or Watchdog.for_run(cfg.fault, out, ctx.rank, ctx.world_size, ctx.backend),
              every_minutes=every_minutes_of(cfg.checkpoint.every_minutes, out, ctx.world_size))
    run.watch.track(DeviceProgress.on(ctx.device))  # what the GPU finished, in each heartbeat (step.py marks it)
    if cfg.checkpoint.every_minutes == "auto":
        log(ctx, f"checkpoint.every_minutes=auto, {advice_line(out, ctx.world_size)}")
    if teacher is not None:
        check_teacher(teacher, cfg, val_loader, ctx)
    m = state.meters
    m.base_mem_mb, m.setup_peak_mem_mb = base_mem, round(peak_memory_mb(ctx.device), 1)
    crops = jpeg_roi.counts()  # counted since the process began: a run in a process that ran others starts here
    m.crop_counts_start = (crops["decoded"], crops["refused"])
    reset_peak_memory(ctx.device)
    if teacher is not None and cfg.log.debug_digest:
        m.teacher_checksum_start = checksum(teacher)
    return run, state


def log(ctx: DistContext, msg: str) -> None:
    """One line of the run's log, on rank 0."""
    if ctx.is_main:
        print(f"[convit-scale] {msg}", flush=True)


def say_first_bad_sample(run: Run, bad_samples: list) -> None:
    """One console line, the first time in this start of the run, for a training sample the loaders replaced
    (unreadable or undecodable); every one of them is a ``bad_sample`` record of metrics.jsonl."""
    if not bad_samples or "bad_sample" in run.said:
        return
    run.said.add("bad_sample")
    first = bad_samples[0]
    where = first.get("shard") or first.get("file") or "?"
    log(run.ctx, f"a training sample was replaced by another of its batch: {where}, key {first.get('key')} "
                 f"({first.get('reason')}); said once: every replaced sample is a bad_sample record in "
                 f"metrics.jsonl, at most data.max_bad_samples = {run.cfg.data.max_bad_samples} per epoch and rank")
