"""The loop: epochs of steps until ``total_steps``, logged at log steps, evaluated and analysed at epoch ends,
checkpointed periodically, on a stop signal and at the end.

    while state.step < run.total_steps:
        for micro_batches in steps_of_epoch(run, state):
            res = train_step(run, state, micro_batches)   # one packed reduction, the non-finite decision
            log_step(run, state, res, progress)           # host values only at log steps
            if res.stop: return save_and_stop(run, state)
        if close_epoch(run, state): return save_and_stop(run, state)  # evaluation, analysis, epoch checkpoint
"""

from __future__ import annotations

import contextlib
import time

import torch

from .. import comm, evaluation, faults, jpeg_roi
from ..analysis.during_training import epoch_analysis
from ..data import device_images
from ..runfolder import STOPPED_FOR_REQUEUE
from .checkpoint import save_best, save_checkpoint, wait_for_save
from .debug import checksum, state_digest
from .memory import peak_memory_mb
from .progress import Progress
from .setup import Run, log, say_first_bad_sample
from .signals import EXIT_REQUEUE
from .state import TrainState
from .step import StepResult, steps_of_epoch, train_step
from .watchdog import EPOCH_START, EVAL, LOG, SAVE, long_collective_timeout_s


def log_step(run: Run, state: TrainState, res: StepResult, progress: Progress) -> None:
    """metrics.jsonl (and a log line) at log steps: the only place where the step's host values are written."""
    cfg, m = run.cfg, state.meters
    m.images_since_log += cfg.data.global_batch_size
    m.steps_since_log += 1
    for record in res.bad_samples:  # every step that has any: one record per replaced sample
        run.metrics.write({"kind": "bad_sample", "step": state.step, "epoch": state.epoch, **record})
    say_first_bad_sample(run, res.bad_samples)  # and the first on the console
    every = cfg.log.every_steps
    if (every and state.step % every == 0) or res.log_due or state.step == run.total_steps:
        now = time.time()
        seconds = max(now - m.last_log_time, 1e-9)
        grad_norm = res.grad_norm if res.grad_norm is not None or res.bad else run.strategy.reported_grad_norm()
        crops, (boxes0, refused0) = jpeg_roi.counts(), m.crop_counts_start
        ranks = comm.all_gather_object((round(peak_memory_mb(run.ctx.device), 1), crops["decoded"] - boxes0,
                                        crops["refused"] - refused0, device_images.REFUSED[0]))
        rec = {"kind": "train", "step": state.step, "epoch": state.epoch, "loss": None if res.bad else res.loss,
               "lr": res.lr, "images_per_s": m.images_since_log / seconds, "step_time_s": seconds / m.steps_since_log,
               "grad_norm": grad_norm, "peak_mem_mb": [r[0] for r in ranks],
               "base_mem_mb": m.base_mem_mb, "setup_peak_mem_mb": m.setup_peak_mem_mb,
               "skipped_steps": state.skipped_steps, "state_mem_mb": m.state_mem_mb,
               # the train crops decoded as boxes, and the JPEGs the crop-region decoder refused (decoded whole, or
               # replaced as bad samples), on all ranks since this start
               "crop_boxes_decoded": sum(r[1] for r in ranks), "crop_decode_refused": sum(r[2] for r in ranks),
               # data.decode_on: device: the JPEGs its decoder refused, decoded by PIL on the host instead
               "device_decode_refused": sum(r[3] for r in ranks)}
        run.metrics.write(rec)
        m.last_log_time, m.images_since_log, m.steps_since_log = now, 0, 0
        progress.log_step(rec, run.total_steps)
    if cfg.log.debug_samples:  # the global batch in canonical order: ranks hold consecutive groups
        ids = [i for rank_ids in comm.all_gather_object(res.sample_ids) for i in rank_ids]
        run.metrics.write({"kind": "samples", "step": state.step, "epoch": state.epoch, "ids": ids})
    if cfg.log.debug_digest:
        digests = comm.all_gather_object(state_digest(run.strategy.optimizer_tensors()))
        run.metrics.write({"kind": "digest", "step": state.step, "bad": res.bad, "state_digest": digests})
    progress.advance(state.step)


def _eval_due(run: Run, state: TrainState, epoch: int) -> bool:
    """Evaluation every ``run.eval_every_epochs`` and at the end (a short epoch, as on a small Table 2 subset, would
    otherwise spend more on its analysis than on its steps)."""
    every = run.cfg.run.eval_every_epochs
    return run.val_loader is not None and ((epoch + 1) % every == 0 or state.step >= run.total_steps)


def end_of_epoch(run: Run, state: TrainState, epoch: int) -> None:
    """Evaluation and the gating/nonlocality analysis where due (``_eval_due``)."""
    if not _eval_due(run, state, epoch):
        return
    if run.faults is not None:
        run.faults.before_eval(epoch)
    with long_phase(run, EVAL):
        _evaluate_and_analyse(run, state, epoch)


def _evaluate_and_analyse(run: Run, state: TrainState, epoch: int) -> None:
    cfg = run.cfg
    run.strategy.train(False)
    try:
        results = evaluation.evaluate(run.strategy.forward, run.val_loader, run.ctx.device)
    finally:
        run.strategy.train(True)
    results = state.record_eval(epoch, results)  # final and best top-1/top-5
    run.metrics.write({"kind": "eval", "step": state.step, "epoch": epoch, **results})
    log(run.ctx, f"epoch {epoch} step {state.step}: top-1 {results['top1']:.2f} top-5 {results['top5']:.2f} "
                 f"({results['samples']} images); best top-1 {results['best_top1']:.2f} "
                 f"(epoch {results['best_epoch']})")
    full = run.strategy.full_state_dict()  # gathered once (collective; rank 0 holds it): the analysis, the best
    stats = epoch_analysis(full, cfg, run.val_loader, run.ctx)
    if stats is not None:
        run.metrics.write({"kind": "analysis", "step": state.step, "epoch": epoch, **stats})
    if results["best_epoch"] == epoch:
        path = save_best(run.checkpoints, full, {**_meta(run, state, "best"), "eval": results})
        log(run.ctx, f"best top-1 so far: {path} (epoch {epoch})")
    state.meters.final.update(results)


def _epoch_finished(run: Run, state: TrainState) -> bool:
    return state.batch_in_epoch // run.accum >= run.steps_per_epoch


def close_epoch(run: Run, state: TrainState) -> bool:
    """After an epoch's last step (or on resuming from a checkpoint saved there, before its evaluation): evaluate
    and analyse it, move to the next epoch, and save the epoch checkpoint (after its evaluation). Returns whether a
    stop signal came before or during the evaluation (agreed by every rank): the run then stops here, the stop's
    checkpoint in place of the epoch's, instead of after the next epoch's first step (its loader's start, a step,
    and an epoch save the stop's would follow, all inside the signal's lead before the time limit). One that came
    before it (in the epoch's last save) stops before it: the resumed run evaluates the epoch first."""
    if run.faults is not None:
        run.faults.before_close(state.epoch)
    evaluating = state.step < run.total_steps and _eval_due(run, state, state.epoch)  # (the end saves anyway)
    if evaluating and _stop_agreed(run):
        return True
    end_of_epoch(run, state, state.epoch)
    state.epoch, state.batch_in_epoch = state.epoch + 1, 0
    if evaluating and _stop_agreed(run):
        return True
    _periodic_save(run, state, run.cfg.checkpoint.every_epochs, state.epoch, "epoch")
    return False


def _stop_agreed(run: Run) -> bool:
    """Whether any rank received a stop signal (one small all-reduce, as the step's reduction carries it)."""
    return comm.all_reduce(torch.tensor([float(run.stop.requested)]), "max").item() > 0


def _meta(run: Run, state: TrainState, reason: str) -> dict:
    """What a checkpoint records beside the state: where the run is, why it saved, and its resolved recipe."""
    cfg = run.cfg
    return {**state.to_meta(run.accum, run.ctx.world_size), "reason": reason, "strategy": cfg.parallel.strategy,
            "model": cfg.model.name, "global_batch_size": cfg.data.global_batch_size, "config": cfg.to_dict(),
            "time": time.time()}


@contextlib.contextmanager
def long_phase(run: Run, phase: str):
    """A phase of the long timeouts (a checkpoint, an evaluation): the watchdog's ``fault.long_phase_timeout_s``, and
    the process group's start-up timeout (``long_collective_timeout_s``) instead of the short one of the steps."""
    run.watch.mark(phase)
    short = run.watch.started and comm.set_timeout(long_collective_timeout_s(run.cfg.parallel, run.cfg.fault))
    try:
        yield
    finally:
        if short:
            comm.set_timeout(run.cfg.fault.collective_timeout_s)


def save(run: Run, state: TrainState, reason: str):
    """A checkpoint; beside training (checkpoint.async_save) for the periodic ones, at once for the end, a stop and
    the save after one in flight that failed (every save waits for the one in flight first). ``save_s`` is the time
    the step was held."""
    t0 = time.time()
    with long_phase(run, SAVE):  # the wait for the save in flight too: a write of minutes is no hang
        failed = _settle_in_flight(run, state, reason)
        background = (run.cfg.checkpoint.async_save and reason not in ("end", "signal") and not failed
                      and not state.meters.retry_save)
        path = save_checkpoint(run.checkpoints, run.strategy, _meta(run, state, reason), run.cfg.checkpoint.keep_last,
                               background=background)
    seconds = time.time() - t0
    state.meters.last_save_time, state.meters.retry_save = time.monotonic(), False
    run.metrics.write({"kind": "checkpoint", "step": state.step, "reason": reason, "save_s": round(seconds, 3),
                       "background": background})
    log(run.ctx, f"checkpoint {path} (step {state.step}, {reason}, {seconds:.1f} s"
                 f"{', written beside training' if background else ''})")
    return path


def _settle_in_flight(run: Run, state: TrainState, reason: str, then: str | None = None) -> bool:
    """Wait for the save in flight, if any; whether it failed on any rank (agreed by every rank: the save that
    follows is a collective, made alike everywhere). Its failure is logged and recorded, and the save being made
    goes ahead, at once: raised here, it would end a stop without the checkpoint the stop is for (and without its
    requeue), the end without the final state, a run without its next checkpoint. A failure of this save too is the
    run's error. The gloo group of the background saves is destroyed and made anew at the next one (a collective
    that timed out leaves its group unusable). ``reason``: the save that follows (recorded with the failure);
    ``then``: what the log says comes next, where that is not this save at once."""
    if not run.cfg.checkpoint.async_save:
        return False  # nothing was saved beside training
    error = None
    try:
        wait_for_save()
    except (KeyboardInterrupt, SystemExit):
        raise
    except BaseException as e:  # DCP's CheckpointException is a BaseException
        error = f"{type(e).__name__}: {e}"[:500]
    errors = [e for e in comm.all_gather_object(error) if e]
    if not errors:
        return False
    then = then or f"the {reason} checkpoint of step {state.step} is saved at once"
    log(run.ctx, f"the checkpoint written beside training was not published ({errors[0]}); {then}")
    run.metrics.write({"kind": "checkpoint_failed", "step": state.step, "reason": reason, "error": errors[0]})
    group, run.strategy.save_group = run.strategy.save_group, None
    if group is not None:
        comm.destroy_group(group)
    return True


def settle_saves(run: Run, failing: bool) -> None:
    """The way out of ``fit``, on every path: wait for the save in flight (published once every rank's write
    completed). When the run is already failing, that save's own failure is logged, not raised: the run's error is
    the one reported."""
    try:
        wait_for_save()
    except BaseException as e:
        if not failing:
            raise
        log(run.ctx, f"the checkpoint being written beside training was not published: {type(e).__name__}: {e}")


def save_and_stop(run: Run, state: TrainState) -> str:
    path = save(run, state, "signal")
    log(run.ctx, f"stop signal: saved {path}; exiting with {EXIT_REQUEUE} to be requeued")
    run.metrics.write({"kind": "stopped", "step": state.step, "epoch": state.epoch, "checkpoint": str(path)})
    if run.ctx.is_main:  # for launchers (torchrun) that do not pass the exit status through
        (run.out / STOPPED_FOR_REQUEUE).write_text(str(path))
    comm.barrier()
    return "stopped"


def _due(every: int | None, count: int) -> bool:
    """Whether a periodic save of every ``every`` (steps, epochs; None: never) falls at ``count``."""
    return bool(every) and count % every == 0


def _periodic_save(run: Run, state: TrainState, every: int | None, count: int, reason: str) -> None:
    """A periodic checkpoint, never from a state that followed a bad step without a good one after it."""
    if _due(every, count) and state.step < run.total_steps and state.consecutive_bad == 0:
        save(run, state, reason)


def _first_step(run: Run, state: TrainState, resumed_from: int) -> None:
    """After the first step of this start: the short collective timeout from now on (torchtitan's), and, after a
    restart, the fault that caused it completed with the time back and the steps redone."""
    if comm.set_timeout(run.cfg.fault.collective_timeout_s):
        log(run.ctx, f"collective timeout {run.cfg.fault.collective_timeout_s:g} s from now on "
                     f"({long_collective_timeout_s(run.cfg.parallel, run.cfg.fault):g} s during start-up, checkpoints, "
                     f"evaluation)")
    rec = faults.recovered(run.out, resumed_from, state.step) if run.ctx.is_main and resumed_from > 0 else None
    if rec is not None:
        log(run.ctx, f"recovered from the {rec['kind'].replace('_', ' ')} of rank {rec.get('rank')} on "
                     f"{rec.get('node')}: step {state.step} done {rec['back_s']:g} s after it was detected, "
                     f"{rec['steps_redone']} step(s) redone from checkpoint step {resumed_from}")


def _retry_save(run: Run, state: TrainState, failed_now: bool) -> None:
    """A save beside training failed (every rank knows it at the same step: ``StepTotals.save_failed`` of the first
    step after its thread ended, or the save that settled it): saved again at once from this step, unless the
    state follows a bad step (then from the first step after a good one) or the epoch's or the end's save follows
    this step (that one is made at once). A failure found now is logged and recorded first."""
    if failed_now:
        state.meters.retry_save = True
    epoch_save = _epoch_finished(run, state) and _due(run.cfg.checkpoint.every_epochs, state.epoch + 1)
    if state.step < run.total_steps and state.consecutive_bad == 0 and not epoch_save:
        save(run, state, "retry")
    elif failed_now:
        with long_phase(run, SAVE):
            _settle_in_flight(run, state, "pending",
                              "the next save is made at once (after a good step, or the epoch's or the end's)")


def _after_step(run: Run, state: TrainState, res: StepResult, resumed_from: int) -> None:
    """The checkpoints a step may end with (a failed save's retry, every_steps, every_minutes), then the watchdog's
    progress mark."""
    cfg = run.cfg.checkpoint
    if res.save_failed or state.meters.retry_save:
        _retry_save(run, state, res.save_failed)  # in place of a periodic save due at this step
    else:
        if res.save_due and not _due(cfg.every_steps, state.step):
            _periodic_save(run, state, 1, state.step, "every_minutes")
        _periodic_save(run, state, cfg.every_steps, state.step, "every_steps")
    first = not run.watch.started
    run.watch.step_done(state.step)
    if first:
        _first_step(run, state, resumed_from)


def fit(run: Run, state: TrainState) -> str:
    """Epochs of steps until ``total_steps``; returns "finished", or "stopped" after a stop signal and a save."""
    cfg, resumed_from = run.cfg, state.step
    run.strategy.train(True)
    with Progress.for_run(run.ctx.is_main, cfg.log.progress, run.total_steps, state.step) as progress:
        while state.step < run.total_steps:
            run.watch.mark(EPOCH_START, state.step)
            run.watch.publish()  # where this start begins, at once (a rank may die before the next heartbeat)
            for micro_batches in steps_of_epoch(run, state):
                res = train_step(run, state, micro_batches)
                run.watch.mark(LOG, state.step)
                log_step(run, state, res, progress)
                if res.stop:
                    return save_and_stop(run, state)
                _after_step(run, state, res, resumed_from)
            if _epoch_finished(run, state) and close_epoch(run, state):
                return save_and_stop(run, state)
        if not state.meters.final and run.val_loader is not None:  # max_steps ended mid-epoch: evaluate the end
            end_of_epoch(run, state, state.epoch if state.batch_in_epoch else state.epoch - 1)
    _finish(run, state, save(run, state, "end"))
    return "finished"


def _finish(run: Run, state: TrainState, path) -> None:
    """The end record (final and best evaluation, steps, the end checkpoint) and the teacher's digest check."""
    final = {**state.meters.final, "step": state.step, "skipped_steps": state.skipped_steps, "checkpoint": str(path)}
    if run.teacher is not None and run.cfg.log.debug_digest:  # the teacher never trains: same weights as loaded
        run.metrics.write({"kind": "distill", "step": state.step,
                           "teacher_checksum_start": state.meters.teacher_checksum_start,
                           "teacher_checksum_end": checksum(run.teacher), "teacher_in_optimizer": any(
                               p is q for g in run.strategy.optimizer.param_groups for p in g["params"]
                               for q in run.teacher.parameters())})
    run.metrics.write({"kind": "end", **final})
    paper, key = run.cfg.paper, run.cfg.paper.compare_with
    if paper.top1 is not None and key in final:  # the number to set beside the paper's (Table 1 is the final epoch)
        log(run.ctx, f"the paper's Table {paper.table} {paper.row}: top-1 {paper.top1}; this run: {key} "
                     f"{final[key]:.2f} (final {final['top1']:.2f}, best {final['best_top1']:.2f} at epoch "
                     f"{final['best_epoch']})")
