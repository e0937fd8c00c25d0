"""The training loop: one loop for DDP, FSDP2 and DeepSpeed ZeRO, with exact resume.

Order of a run: validate the config (before any process group) -> process group -> solve the global
batch -> model -> strategy -> loaders -> resume -> epochs of steps (each a fixed number of
micro-batches) -> periodic eval, analysis, checkpoints -> final eval and checkpoint.
"""

from __future__ import annotations

import math
import os
import resource
import signal
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from timm.loss import SoftTargetCrossEntropy

from ..config import Config, model_options
from ..data import LoaderSpec, build_loader
from ..data.plan import sample_seed
from ..data.transforms import build_mixup, seed_all
from ..metrics import MetricsWriter
from ..models import MODELS, create_model
from ..models.checkpoints import convert_state_dict, check_state_dict, read_state_dict
from ..parallel import build_strategy, preload
from .checkpoint import latest_checkpoint, load_checkpoint, save_checkpoint
from .distributed import DistContext, all_reduce_max, check_launcher_env, init_distributed, solve_batch
from .optim import build_optimizer
from .schedule import lr_at, peak_lr

# Exit status of a run stopped by SIGUSR1/SIGTERM after saving: the Slurm scripts requeue on it.
EXIT_REQUEUE = 75


class NonFiniteLoss(RuntimeError):
    pass


class _StopFlag:
    """Set by SIGUSR1 / SIGTERM (Slurm's pre-timeout signal, preemption); read at step boundaries."""

    def __init__(self):
        self.signum: int | None = None
        for s in (signal.SIGUSR1, signal.SIGTERM):
            signal.signal(s, self._handler)

    def _handler(self, signum, frame):
        self.signum = signum


def _peak_memory_mb(device: torch.device) -> float:
    """Peak memory of this rank since the last ``_reset_peak_memory`` (process start if never reset)."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    try:  # VmHWM can be reset (see below); ru_maxrss cannot
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) / 1024  # kB
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux: KiB


def _tensor_memory_mb(device: torch.device, module: torch.nn.Module) -> float:
    """Memory held by live tensors on this rank. Taken after backward, before the optimizer step: the
    model state (parameters, gradients, optimizer moments) and the strategy's persistent buffers, without
    allocator slack, freed activations or the communication library's own buffers. CUDA: the caching
    allocator's count; CPU: every tensor storage reachable from Python, each counted once (views and
    shards of one flat buffer included); tensors that live only in C++ (DDP's reducer buckets) are not
    seen."""
    if device.type == "cuda":
        return torch.cuda.memory_allocated(device) / 2**20
    import gc

    grads = [p.grad for p in module.parameters()]  # noqa: F841 (gives autograd's gradients a Python object)

    storages: dict[int, int] = {}
    for obj in gc.get_objects():
        try:  # dead weak proxies raise on isinstance; wrapper subclasses (DTensor) have no storage of
            # their own (their local tensors are seen)
            if not isinstance(obj, torch.Tensor) or obj.is_meta or obj.device.type != "cpu":
                continue
            st = obj.untyped_storage()
            ptr, nbytes = st.data_ptr(), st.nbytes()
        except (ReferenceError, RuntimeError, NotImplementedError, TypeError):
            continue
        storages[ptr] = max(storages.get(ptr, 0), nbytes)
    return sum(storages.values()) / 2**20


def _reset_peak_memory(device: torch.device) -> None:
    """Start peak tracking at the training steps: set-up (a whole model built before sharding,
    DeepSpeed's partitioning copies) has its own, earlier peak, which `setup_peak_mem_mb` records."""
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
        return
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # Linux >= 4.0: reset the peak resident set size (VmHWM)
    except OSError:
        pass


def _progress(enabled: bool):
    from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn

    return Progress(TextColumn("[bold]{task.description}"), BarColumn(), TextColumn("{task.completed}/{task.total}"),
                    TextColumn("{task.fields[info]}"), TimeElapsedColumn(), TimeRemainingColumn(),
                    disable=not enabled, transient=False)


def build_model(cfg: Config, meta: bool = False):
    torch.manual_seed(cfg.run.seed)  # the same initial weights on every rank and world size
    model = create_model(cfg.model.name, device="meta" if meta else None, **model_options(cfg.model))
    if cfg.model.pretrained:
        sd = convert_state_dict(read_state_dict(cfg.model.pretrained), model)
        check_state_dict(sd, model, cfg.model.pretrained)
        if not meta:
            model.load_state_dict(sd)
    return model


def _loss_fn(cfg: Config):
    if cfg.data.mixup > 0 or cfg.data.cutmix > 0:
        return SoftTargetCrossEntropy()  # targets from Mixup already carry the label smoothing
    return lambda logits, y: F.cross_entropy(logits, y, label_smoothing=cfg.data.label_smoothing)


@torch.no_grad()
def evaluate(strategy, loader, ctx: DistContext, max_batches: int | None = None) -> dict:
    """Top-1/top-5 over the whole split, sharded across ranks with exact counting."""
    strategy.train(False)
    counts = torch.zeros(4, dtype=torch.float64)  # correct@1, correct@5, loss sum, samples
    seen = 0
    for i, (x, y) in enumerate(loader.epoch(0)):
        if max_batches is not None and i >= max_batches:
            break
        x, y = x.to(ctx.device, non_blocking=True), y.to(ctx.device)
        logits = strategy.forward(x).float()
        real = (torch.arange(len(y), device=y.device) + seen) < loader.num_real  # padding does not count
        seen += len(y)
        k = min(5, logits.shape[1])
        top = logits.topk(k, dim=1).indices
        hit = top == y[:, None]
        counts += torch.tensor([hit[:, 0][real].sum().item(), hit[real].any(1).sum().item(),
                                F.cross_entropy(logits[real], y[real], reduction="sum").item() if real.any() else 0.0,
                                real.sum().item()], dtype=torch.float64)
    dist.all_reduce(counts)
    strategy.train(True)
    n = max(counts[3].item(), 1)
    return {"top1": 100 * counts[0].item() / n, "top5": 100 * counts[1].item() / n,
            "loss": counts[2].item() / n, "samples": int(counts[3].item())}


def _analysis(strategy, cfg: Config, images: torch.Tensor | None) -> dict | None:
    """Gating per layer/head and nonlocality per layer, from a full copy on rank 0."""
    from ..analysis.metrics import gating, nonlocality

    state = strategy.full_state_dict()  # collective
    if state is None or images is None:
        return None
    plain = create_model(cfg.model.name, **{**model_options(cfg.model), "drop_path_rate": 0.0})
    plain.load_state_dict(state)
    return {"gating": gating(plain), "nonlocality": nonlocality(plain, images)}


def train(cfg: Config) -> dict:
    """Run the recipe on this rank; returns the final metrics (rank 0) or {}."""
    stop = _StopFlag()
    ctx = init_distributed(cfg.parallel.backend, cfg.parallel.timeout_s)
    out = Path(cfg.run.output_dir)
    try:
        return _train(cfg, ctx, out, stop)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
        if ctx.launcher == "alone":  # the one-process group's variables must not leak into a next run
            for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
                os.environ.pop(key, None)


def _log(ctx: DistContext, msg: str) -> None:
    if ctx.is_main:
        print(msg, flush=True)


def _train(cfg: Config, ctx: DistContext, out: Path, stop: _StopFlag) -> dict:
    micro, accum = solve_batch(cfg.data.global_batch_size, ctx.world_size, cfg.data.micro_batch_size)
    if (cfg.data.mixup > 0 or cfg.data.cutmix > 0) and micro % 2:
        raise ValueError(f"Mixup/CutMix need an even micro-batch; {micro} per rank here (data.micro_batch_size)")
    lr = peak_lr(cfg.optim.base_lr, cfg.data.global_batch_size, cfg.optim.lr_reference_batch)
    if ctx.is_main:
        out.mkdir(parents=True, exist_ok=True)
        (out / "config.yaml").write_text(cfg.to_yaml())
    _log(ctx, f"[convit-scale] {cfg.model.name} | strategy {cfg.parallel.strategy} | {ctx.world_size} rank(s) on "
              f"{ctx.device.type} ({ctx.backend}, launched by {ctx.launcher}) | global batch "
              f"{cfg.data.global_batch_size} = micro {micro} x accumulation {accum} x world {ctx.world_size} | "
              f"lr {lr:.3g} = {cfg.optim.base_lr:g} x {cfg.data.global_batch_size}/{cfg.optim.lr_reference_batch}")

    img_size = cfg.model.img_size or MODELS[cfg.model.name].img_size
    train_loader = build_loader(cfg.data, LoaderSpec("train", img_size, micro, ctx.world_size, ctx.rank, cfg.run.seed))
    val_loader = build_loader(cfg.data, LoaderSpec("val", img_size, cfg.data.eval_batch_size, ctx.world_size,
                                                   ctx.rank, cfg.run.seed)) if cfg.data.val_path else None
    steps_per_epoch = len(train_loader) // accum
    if steps_per_epoch == 0:
        raise ValueError(f"{train_loader.num_samples} training images give no full global batch of "
                         f"{cfg.data.global_batch_size} per epoch")
    total_steps = cfg.schedule.epochs * steps_per_epoch
    if cfg.schedule.max_steps is not None:
        total_steps = min(total_steps, cfg.schedule.max_steps)

    preload(cfg.parallel.strategy)  # library code belongs to the baseline, not to the model's memory
    base_mem = round(_peak_memory_mb(ctx.device), 1)  # before the model: what the process costs without it
    model = build_model(cfg, meta=cfg.parallel.meta_init)
    strategy = build_strategy(model, cfg.parallel, ctx.device, ctx.world_size, cfg.optim.grad_clip)
    strategy.setup(lambda m: build_optimizer(m, cfg.optim, lr), micro, accum)
    if cfg.parallel.meta_init and cfg.model.pretrained:
        strategy.load_full_state_dict(convert_state_dict(read_state_dict(cfg.model.pretrained), strategy.module))

    teacher = None
    if cfg.distill.enabled:
        from .distill import DistillLoss, load_teacher

        teacher = load_teacher(cfg, ctx.device)
        criterion = DistillLoss(_loss_fn(cfg), teacher, cfg.distill, precision=cfg.parallel.precision)
        teacher_checksum = _checksum(teacher)
    else:
        base_loss = _loss_fn(cfg)
        criterion = lambda x, logits, y: base_loss(logits, y)  # noqa: E731
    mixup = build_mixup(cfg.data, cfg.model.num_classes)

    # -- resume ----------------------------------------------------------------------------------
    step, epoch, batch_in_epoch, skipped_total = 0, 0, 0, 0
    ckpt_root = out / "checkpoints"
    resume = cfg.checkpoint.resume
    path = latest_checkpoint(ckpt_root) if resume == "auto" else (None if resume == "none" else Path(resume))
    if path is not None:
        if not (path / "meta.json").is_file():
            raise FileNotFoundError(f"checkpoint.resume: {path} is not a complete checkpoint (no meta.json)")
        meta = load_checkpoint(path, strategy)
        step, epoch, skipped_total = meta["step"], meta["epoch"], meta.get("skipped_steps", 0)
        # same world size: continue at the same micro-batch; otherwise at the same optimizer step
        batch_in_epoch = meta["batch_in_epoch"] if meta["world_size"] == ctx.world_size else meta["step_in_epoch"] * accum
        _log(ctx, f"[convit-scale] resumed from {path} at step {step} (epoch {epoch}, batch {batch_in_epoch})")

    setup_mem = round(_peak_memory_mb(ctx.device), 1)
    state_mem = None  # tensor memory per rank before the second optimizer step: the model state
    _reset_peak_memory(ctx.device)
    metrics = MetricsWriter(out, ctx.is_main, cfg.log.tensorboard)
    if ctx.is_main:
        (out / "STOPPED_FOR_REQUEUE").unlink(missing_ok=True)
    analysis_images = None
    if ctx.is_main and val_loader is not None:
        analysis_images = next(iter(val_loader.epoch(0)))[0][:16]

    def checkpoint(reason: str) -> Path:
        meta = {"step": step, "epoch": epoch, "batch_in_epoch": batch_in_epoch,
                "step_in_epoch": batch_in_epoch // accum, "world_size": ctx.world_size,
                "skipped_steps": skipped_total, "reason": reason, "strategy": cfg.parallel.strategy,
                "model": cfg.model.name, "config": cfg.to_dict(), "time": time.time()}
        return save_checkpoint(ckpt_root, strategy, meta, cfg.checkpoint.keep_last)

    def end_of_epoch(ep: int) -> None:
        results = {}
        if val_loader is not None and ((ep + 1) % cfg.run.eval_every_epochs == 0 or step >= total_steps):
            results = evaluate(strategy, val_loader, ctx)
            metrics.write({"kind": "eval", "step": step, "epoch": ep, **results})
            _log(ctx, f"[convit-scale] epoch {ep} step {step}: top-1 {results['top1']:.2f} top-5 {results['top5']:.2f} "
                      f"({results['samples']} images)")
        stats = _analysis(strategy, cfg, analysis_images)
        if stats is not None:
            metrics.write({"kind": "analysis", "step": step, "epoch": ep, **stats})
        final.update(results)

    final: dict = {}
    strategy.train(True)
    consecutive_bad = 0
    t_last, imgs_since = time.time(), 0
    with _progress(ctx.is_main and cfg.log.progress) as progress:
        task = progress.add_task("train", total=total_steps, completed=step, info="")
        while step < total_steps:
            steps_done_in_epoch = batch_in_epoch // accum
            if steps_done_in_epoch >= steps_per_epoch:  # the epoch was finished before a resume
                epoch, batch_in_epoch = epoch + 1, 0
                continue
            it = iter(train_loader.epoch(epoch, start_batch=batch_in_epoch))
            while steps_done_in_epoch < steps_per_epoch and step < total_steps:
                # Per-step seeds: Mixup and drop-path draw the same numbers after a resume.
                seed_all(sample_seed(cfg.run.seed, epoch, ctx.rank, 10**9 + step))
                cur_lr = lr_at(step, lr, steps_per_epoch, cfg.schedule)
                strategy.set_lr(cur_lr)
                bad, loss_sum = False, torch.zeros((), dtype=torch.float64)
                for m in range(accum):
                    x, y = next(it)
                    x, y = x.to(ctx.device, non_blocking=True), y.to(ctx.device, non_blocking=True)
                    target = y
                    if mixup is not None:
                        x, target = mixup(x, y)
                    out_logits = strategy.forward(x)  # a (class, distillation) pair with a distillation token
                    logits = tuple(o.float() for o in out_logits) if isinstance(out_logits, tuple) else out_logits.float()
                    loss = criterion(x, logits, target)
                    if _fault_injection(step, m, ctx):
                        loss = loss * float("nan")
                    bad_here = all_reduce_max(not torch.isfinite(loss).item(), ctx.device) > 0
                    if bad_here:
                        bad = True
                        if cfg.run.nonfinite_policy == "stop":
                            raise NonFiniteLoss(f"non-finite loss at step {step} (epoch {epoch}); stopped without "
                                                f"saving (run.nonfinite_policy = 'stop'); the last checkpoint is intact")
                        # keep collectives in step on every rank; these gradients are discarded below
                        first = logits[0] if isinstance(logits, tuple) else logits
                        loss = first.sum() * 0.0
                    strategy.backward(loss, is_last_micro=m == accum - 1, grad_accum=accum)
                    loss_sum += loss.detach().double().cpu()
                    batch_in_epoch += 1
                if state_mem is None and step > 0 and not bad:
                    # once, with gradients accumulated and the optimizer moments in place (a step was taken)
                    state_mem = [None] * ctx.world_size
                    dist.all_gather_object(state_mem, round(_tensor_memory_mb(ctx.device, strategy.module), 1))
                if bad:
                    strategy.skip_step()
                    grad_norm = float("nan")
                    skipped_total += 1
                    consecutive_bad += 1
                    if consecutive_bad > cfg.run.max_skipped_steps:
                        raise NonFiniteLoss(f"{consecutive_bad} consecutive non-finite steps (run.max_skipped_steps = "
                                            f"{cfg.run.max_skipped_steps}); stopped without saving")
                else:
                    grad_norm = strategy.step()
                    consecutive_bad = 0
                step += 1
                steps_done_in_epoch += 1
                imgs_since += cfg.data.global_batch_size
                mean_loss = torch.tensor([loss_sum.item() / accum], dtype=torch.float64)
                dist.all_reduce(mean_loss)
                mean_loss = mean_loss.item() / ctx.world_size
                if step % cfg.log.every_steps == 0 or step == total_steps:
                    now = time.time()
                    mem = [None] * ctx.world_size
                    dist.all_gather_object(mem, round(_peak_memory_mb(ctx.device), 1))
                    rec = {"kind": "train", "step": step, "epoch": epoch, "loss": None if bad else mean_loss,
                           "lr": cur_lr, "images_per_s": imgs_since / max(now - t_last, 1e-9),
                           "grad_norm": None if math.isnan(grad_norm) else grad_norm,
                           "peak_mem_mb": mem, "base_mem_mb": base_mem, "setup_peak_mem_mb": setup_mem,
                           "skipped_steps": skipped_total, "state_mem_mb": state_mem}
                    metrics.write(rec)
                    t_last, imgs_since = now, 0
                    progress.update(task, info=f"loss {mean_loss:.4f} lr {cur_lr:.2e} {rec['images_per_s']:.0f} img/s")
                progress.update(task, completed=step)
                if all_reduce_max(stop.signum is not None, ctx.device) > 0:
                    path = checkpoint("signal")
                    _log(ctx, f"[convit-scale] stop signal: saved {path}; exiting with {EXIT_REQUEUE} to be requeued")
                    metrics.write({"kind": "stopped", "step": step, "epoch": epoch, "checkpoint": str(path)})
                    if ctx.is_main:  # for launchers (torchrun) that do not pass the exit status through
                        (out / "STOPPED_FOR_REQUEUE").write_text(str(path))
                    dist.barrier()
                    dist.destroy_process_group()
                    sys.exit(EXIT_REQUEUE)
                if cfg.checkpoint.every_steps and step % cfg.checkpoint.every_steps == 0 and step < total_steps:
                    checkpoint("every_steps")
            if steps_done_in_epoch >= steps_per_epoch:  # a whole epoch
                end_of_epoch(epoch)
                epoch_done = epoch
                epoch, batch_in_epoch = epoch + 1, 0
                if (epoch_done + 1) % cfg.checkpoint.every_epochs == 0 and step < total_steps:
                    checkpoint("epoch")
        if step >= total_steps and not final and val_loader is not None:
            end_of_epoch(epoch if batch_in_epoch else epoch - 1)
    path = checkpoint("end")
    final.update(step=step, skipped_steps=skipped_total, checkpoint=str(path))
    if teacher is not None:  # the teacher never trains: same weights at the end as loaded
        metrics.write({"kind": "distill", "step": step, "teacher_checksum_start": teacher_checksum,
                       "teacher_checksum_end": _checksum(teacher), "teacher_in_optimizer": any(
                           p is q for g in strategy.optimizer.param_groups for p in g["params"]
                           for q in teacher.parameters())})
    metrics.write({"kind": "end", **final})
    return final if ctx.is_main else {}


def _checksum(module) -> float:
    return float(sum(p.detach().double().sum().item() + p.detach().double().abs().sum().item()
                     for p in module.parameters()))


def _fault_injection(step: int, micro: int, ctx: DistContext) -> bool:
    """CONVIT_SCALE_NAN_AT_STEP=s[:m][,...]: make rank 0's loss of step s (micro-batch m, default 0)
    non-finite (tests of the NaN policy)."""
    marks = os.environ.get("CONVIT_SCALE_NAN_AT_STEP", "").split(",")
    return ctx.rank == 0 and (f"{step}:{micro}" in marks or (micro == 0 and str(step) in marks))


def _launch_rank() -> int:
    """This process's rank as the launcher set it, before any process group exists."""
    return int(os.environ.get("RANK", os.environ.get("SLURM_PROCID", "0")))


def main(argv: list[str] | None = None) -> int:
    import argparse

    from ..config import ConfigError, load_config
    from ..data import DataError
    from ..models.checkpoints import CheckpointMismatch
    from .launch import preflight

    parser = argparse.ArgumentParser(prog="python -m convit_scale.train")
    parser.add_argument("--recipe", required=True)
    parser.add_argument("--no-preflight", action="store_true",
                        help="skip the start-up checks (the launching process has run them)")
    parser.add_argument("overrides", nargs="*")
    args = parser.parse_args(argv)
    try:
        cfg = load_config(args.recipe, args.overrides)
        check_launcher_env(cfg.parallel.strategy, cfg.parallel.precision)
        if not args.no_preflight and _launch_rank() == 0:  # before the process group: the other ranks
            preflight(cfg)                                  # wait at the rendezvous and are stopped with it
    except (ConfigError, DataError, CheckpointMismatch, FileNotFoundError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    try:
        train(cfg)
    except NonFiniteLoss as e:
        print(f"error: {e}", file=sys.stderr)
        return 3
    return 0


__all__ = ["train", "evaluate", "build_model", "main", "EXIT_REQUEUE"]
