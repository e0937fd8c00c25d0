"""One optimizer step: the micro-batches' forward and backward, one packed all-reduce read by the host once, and
the decision (update, or skip a bad step) before anything touches the weights."""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass, field
from typing import NamedTuple

import torch

from .. import comm
from ..data import Batch, DataError
from ..data.device_augment import augment_batch, to_device
from ..data.device_images import StepImages
from ..data.geometry import MicroPart
from ..data.order import step_seed
from ..data.transforms import seed_all
from .checkpoint import save_failed
from .memory import tensor_memory_mb
from .schedule import lr_at
from .setup import Run
from .state import TrainState
from .watchdog import COMPUTE, DATA, REDUCE


class NonFiniteLoss(RuntimeError):
    pass


class StepTotals(NamedTuple):
    """The step's quantities summed over its micro-batches and over the ranks."""

    loss_sum: float
    """Sum of the micro-batch losses, each times its samples (divided by the global batch: the step's mean loss)."""
    bad_loss: float
    """Micro-batches whose loss was not finite."""
    grad_sq: float
    """The squared gradient norm (``Strategy.grad_square_sum``): non-finite for a bad gradient."""
    stop: float
    """Ranks that received a stop signal."""
    bad_samples: float
    """Samples the loaders replaced (unreadable or undecodable)."""
    save_due: float
    """Rank 0's clock says checkpoint.every_minutes have passed since the last save (0 elsewhere): every rank then
    saves after this step, whatever its own clock says."""
    log_due: float
    """Rank 0's clock says log.every_seconds have passed since the last record: every rank logs after this step (the
    log step gathers from every rank)."""
    save_failed: float
    """Ranks whose checkpoint written beside training ended with an error: every rank then settles it and saves again
    after this step, instead of training on without a checkpoint until the next save."""
    decoder_broken: float
    """Ranks whose device decoder refused a whole batch that PIL decodes (``StepImages.broken``): every rank then
    raises it, a ``DataError`` (no restart repeats it), instead of one rank ending alone as a crash."""


class StepStats:
    """The step's one packed all-reduce: a float64 vector on the device with a named slot per ``StepTotals`` field,
    filled without host synchronisation and reduced and read once."""

    def __init__(self, device: torch.device):
        self.vector = torch.zeros(len(StepTotals._fields), dtype=torch.float64, device=device)

    def add(self, name: str, value: torch.Tensor | float) -> None:
        self.vector[StepTotals._fields.index(name)] += value

    def reduce(self) -> StepTotals:
        """The sums over ranks: the step's one all-reduce and its one host read."""
        return self.read(self.start_reduce())

    def start_reduce(self) -> torch.Tensor:
        """The all-reduce, issued (on a GPU the host goes on while it runs); ``read`` waits for its result."""
        return comm.all_reduce(self.vector)

    @staticmethod
    def read(reduced: torch.Tensor) -> StepTotals:
        return StepTotals(*reduced.tolist())


@dataclass
class StepResult:
    loss: float
    """Mean over the global batch's samples (each micro-batch's mean loss weighted by its samples)."""
    grad_norm: float | None
    """The global gradient norm before clipping (None for a bad step, or where DeepSpeed holds it)."""
    bad: bool
    stop: bool
    lr: float
    bad_samples: list = field(default_factory=list)
    """Every rank's replaced samples of the step (``Batch.bad``)."""
    sample_ids: list = field(default_factory=list)
    """This rank's samples of the step, in canonical order (``Batch.ids``; for ``log.debug_samples``)."""
    save_due: bool = False
    """checkpoint.every_minutes elapsed on rank 0's clock (the same decision on every rank)."""
    log_due: bool = False
    """log.every_seconds elapsed on rank 0's clock (the same decision on every rank)."""
    save_failed: bool = False
    """The save in flight failed on some rank (the same on every rank)."""


class _Ahead:
    """An iterator whose next item can be taken early (``peek``) and is still yielded in its turn; an error raised
    while taking it early is raised in its turn too (a loader's refusal ends the run at the step it always did)."""

    def __init__(self, it):
        self._it, self._held, self._error = it, [], None

    def __iter__(self):
        return self

    def __next__(self):
        if self._held:
            return self._held.pop()
        if self._error is not None:
            error, self._error = self._error, None
            raise error
        return next(self._it)

    def peek(self):
        """The next item, without passing it; None at the end, or when taking it raised."""
        if not self._held and self._error is None:
            try:
                self._held.append(next(self._it))
            except StopIteration:
                pass
            except Exception as e:
                self._error = e
        return self._held[0] if self._held else None

    def close(self) -> None:
        self._it.close()


class StepMicroBatches:
    """One step's micro-batches, iterated once (``steps_of_epoch``). ``images``: the epoch's ``StepImages``, which
    moves, decodes and resizes them on the device. ``following()``: the first micro-batch of the epoch's next step,
    taken from the loader now (None after the epoch's or the run's last step); it is still that step's, in turn."""

    def __init__(self, batches: _Ahead, accum: int, images: StepImages, last: bool):
        self._batches, self.accum, self.images, self.last = batches, accum, images, last

    def __iter__(self):
        return itertools.islice(self._batches, self.accum)

    def following(self) -> Batch | None:
        return None if self.last else self._batches.peek()


def steps_of_epoch(run: Run, state: TrainState):
    """The micro-batches of each remaining step of the current epoch, one step at a time (``StepMicroBatches``); the
    loader's epoch is closed when the epoch ends or the loop leaves it early (a micro-batch taken early for a step
    that never ran is dropped with it: the state counts only the micro-batches trained)."""
    batches = _Ahead(run.train_loader.epoch(state.epoch, start_batch=state.batch_in_epoch))
    spec = run.train_loader.spec
    images = StepImages(run.ctx.device, spec.img_size, spec.group_size)
    try:
        while (in_epoch := state.batch_in_epoch // run.accum) < run.steps_per_epoch and state.step < run.total_steps:
            last = in_epoch + 1 >= run.steps_per_epoch or state.step + 1 >= run.total_steps
            yield StepMicroBatches(batches, run.accum, images, last)
    finally:
        batches.close()


def train_step(run: Run, state: TrainState, micro_batches: StepMicroBatches) -> StepResult:
    """Forward/backward over the step's micro-batches, then one packed all-reduce (``StepTotals``) read by the host
    once: a bad step (non-finite loss or gradient) is skipped on every rank alike before any update, and the
    replaced samples are gathered only when some rank has any. Between the all-reduce's start and its read, the next
    step's first micro-batch is made on the device (``_prepare_following``)."""
    cfg, ctx, strategy, watch = run.cfg, run.ctx, run.strategy, run.watch
    if run.faults is not None:
        run.faults.before_step(state.step + 1)
    seed_all(step_seed(cfg.run.seed, state.epoch, state.step))  # the same on every rank: nothing depends on the rank
    lr = lr_at(state.step, run.lr, run.steps_per_epoch, cfg.schedule)
    strategy.set_lr(lr)
    stats, bad_samples, ids, taken = StepStats(ctx.device), [], [], 0
    on_device = micro_batches.images
    for m, batch in enumerate(micro_batches):
        watch.mark(COMPUTE)
        ids.extend(batch.ids or ())
        with strategy.micro_batch(is_last_micro=m == run.accum - 1):
            _micro_step(run, state, batch, m, stats, on_device)
        bad_samples.extend(batch.bad)  # after the step: views the device could not decode are added there
        state.batch_in_epoch, taken = state.batch_in_epoch + 1, m + 1
        watch.mark(DATA)
    if taken != run.accum:
        raise DataError(f"the training loader ended {run.accum - taken} micro-batch(es) early in epoch {state.epoch} "
                        f"(batch {state.batch_in_epoch} of {len(run.train_loader)})")
    if cfg.log.debug_memory and state.meters.state_mem_mb is None and state.step > 0:
        # once, with gradients accumulated and the optimizer moments in place (a step was taken)
        state.meters.state_mem_mb = comm.all_gather_object(round(tensor_memory_mb(ctx.device, strategy.module), 1))
    stats.add("grad_sq", strategy.grad_square_sum())
    stats.add("stop", float(run.stop.requested))
    stats.add("bad_samples", float(len(bad_samples)))  # gathered below only when some rank has any
    stats.add("save_due", float(ctx.is_main and state.meters.save_due(run.every_minutes)))
    stats.add("log_due", float(ctx.is_main and state.meters.log_due(cfg.log.every_seconds)))
    stats.add("save_failed", float(save_failed()))
    broken = on_device.take_broken()  # this step's micro-batches' (the one made early for it included)
    stats.add("decoder_broken", float(bool(broken)))
    watch.mark(REDUCE)
    reduced = stats.start_reduce()
    _prepare_following(run, micro_batches)
    totals = stats.read(reduced)
    if totals.decoder_broken:
        why = next(m for ms in comm.all_gather_object(broken[:1]) for m in ms)
        raise DataError(f"step {state.step + 1}: {why}")
    if totals.bad_samples:
        bad_samples = [{**r, "rank": rank} for rank, rs in enumerate(comm.all_gather_object(bad_samples)) for r in rs]
        _limit_device_bad(run, state, bad_samples)
    # with a loss scaler (fp16) an overflowing gradient is its business, not a bad step; a non-finite loss always is
    bad_grad = not strategy.scales_loss and not math.isfinite(totals.grad_sq)
    norm = math.sqrt(totals.grad_sq) if strategy.norm_is_global and math.isfinite(totals.grad_sq) else None
    if totals.bad_loss or bad_grad:
        _bad_step(run, state, "loss" if totals.bad_loss else "gradient norm")
    else:
        strategy.step(norm)
        state.consecutive_bad = 0
    state.step += 1
    watch.device_mark(state.step, run.accum, "update")  # the device has finished the step when this completes
    bad = bool(totals.bad_loss or bad_grad)
    return StepResult(totals.loss_sum / cfg.data.global_batch_size, None if bad else norm, bad, totals.stop > 0,
                      lr, bad_samples, ids, totals.save_due > 0, totals.log_due > 0, totals.save_failed > 0)


def _prepare_following(run: Run, micro_batches: StepMicroBatches) -> None:
    """The next step's first micro-batch, taken from the loader, moved (decoded, resized) and augmented on the device
    now, while the device still runs this step: the host's share of that work (the hand-over's copy, the decode's
    parsing and nvJPEG's host phase, the resize's plan, the augmentation's draws from the sample seeds, their
    launches) no longer stands between two steps with the device idle after the step's host read. Its bad samples
    and decoder reports count in its own step; nothing it does draws from a random generator's state (the
    augmentation draws from the sample seeds alone), so the numbers are those made in turn."""
    run.watch.mark(DATA)
    batch = micro_batches.following()
    if batch is not None:
        cfg = run.device_augment
        micro_batches.images.prepare(batch, None if cfg is None else lambda x, seeds: augment_batch(x, seeds, cfg))
    run.watch.mark(REDUCE)


def _sample_draws(run: Run, state: TrainState, batch: Batch, part: MicroPart, size: tuple[int, int]) -> tuple:
    """(drop-path decisions, Mixup plan) of the micro-batch of canonical groups ``part`` on the device, or None each:
    drawn on the host from the samples' seeds and the step's canonical groups, moved in one asynchronous copy per
    dtype."""
    keep = None if batch.seeds is None else run.strategy.module.drop_path_keep(batch.seeds)
    plan = []
    if run.mixup is not None:  # whole groups: the micro-batch is part.groups groups of g
        plan = run.mixup.plan(state.epoch, state.step, part.first_group, part.groups, *size)
    moved = to_device(([] if keep is None else [keep]) + plan, run.ctx.device)
    return (None if keep is None else moved[0]), (moved[-len(plan):] if plan else None)


def _micro_step(run: Run, state: TrainState, batch: Batch, m: int, stats: StepStats, on_device: StepImages) -> None:
    """Forward and backward of micro-batch ``m``; its loss and non-finite flag are added to ``stats`` on the device."""
    parts = run.train_loader.spec.micro_parts
    part = parts[m]
    repeated_next = m + 1 < len(parts) and not parts[m + 1].samples
    x, y = on_device(batch, repeated_next)  # resized/decoded there if handed over so; a repeat's images once
    if not part.samples:  # a repeat, weighted 0: its views were counted where they first came
        batch.bad.clear()
    keep, plan = _sample_draws(run, state, batch, part, tuple(x.shape[-2:]))
    if run.device_augment is not None:  # RandAugment, normalisation, erasing; every draw from the sample seed
        early = on_device.augmented(batch)  # made during the step before (``_prepare_following``)
        x = early if early is not None else augment_batch(x, batch.seeds, run.device_augment)
    target = y
    if plan is not None:  # Mixup/CutMix per canonical group: the same pairs and draws at any world size
        x, target = run.mixup.apply(x, y, plan)
    out = run.strategy.forward(x, drop_path_keep=keep)  # a (class, distillation) pair with a distillation token
    logits = tuple(o.float() for o in out) if isinstance(out, tuple) else out.float()
    loss = run.criterion(x, logits, target)
    if run.faults is not None:
        loss = run.faults.apply(loss, state.step, m)
    stats.add("loss_sum", loss.detach() * part.samples)
    stats.add("bad_loss", (~torch.isfinite(loss.detach())).double())
    # before the backward's collectives: a GPU that stops in its forward is told from those that wait for it there
    run.watch.device_mark(state.step + 1, m, f"forward of micro-batch {m + 1}")
    # Every strategy averages the gradient over the ranks and the accumulation (DDP's all-reduce, FSDP2's
    # reduce-scatter, DeepSpeed's mean, and ``grad_accum`` here): a micro-batch's mean loss times
    # samples x world x accum / B makes that average the gradient of the global batch's mean loss whatever each
    # rank holds (1 with equal shares; 0 for a repeat that only keeps the collectives in step).
    weight = part.samples * run.ctx.world_size * run.accum / run.cfg.data.global_batch_size
    run.strategy.backward(loss if weight == 1 else loss * weight, is_last_micro=m == run.accum - 1,
                          grad_accum=run.accum)


def _limit_device_bad(run: Run, state: TrainState, bad_samples: list) -> None:
    """The views the training device could not decode this epoch, every rank's (the same list on every rank: all
    stop alike), against data.max_bad_samples per rank."""
    seen = run.device_bad.get(state.epoch, 0) + sum(1 for r in bad_samples if r.get("device"))
    run.device_bad[state.epoch] = seen
    limit = run.cfg.data.max_bad_samples * run.ctx.world_size
    if seen > limit:
        last = next(r for r in reversed(bad_samples) if r.get("device"))
        raise DataError(f"{seen} views no decoder could read in epoch {state.epoch} on the training devices, over "
                        f"data.max_bad_samples = {run.cfg.data.max_bad_samples} per rank (the last: {last['key']}, "
                        f"{last['reason']})")


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
