"""How often to checkpoint: the Young/Daly interval from the time a save takes and the job's mean time between
failures, and what one failure then costs.

Young (1974) and Daly (2006): with saves of ``C`` seconds and failures every ``M`` seconds on average, the interval
``T = sqrt(2 C M)`` minimises the time lost to saving (C / T of the run) plus the work redone after a failure (T / 2
on average, per failure). What one failure costs is that half interval plus the restart: noticing it, starting the
ranks again and loading the checkpoint.

Without a measured MTBF, the published one: Meta's research clusters measured a mean time to failure of 7.9 h at
1,024 GPUs (1.8 h at 16,384), about one failure per 8,100 GPU-hours, taken here as a constant rate per GPU (an
optimistic reading at the largest scales, where 16,384 GPUs fail every 1.8 h, not 0.5 h).
"""

from __future__ import annotations

import math
import statistics
from pathlib import Path

from .metrics import read_records

GPU_HOURS_PER_FAILURE = 7.9 * 1024
"""One failure per this many GPU-hours: Meta's research clusters, 7.9 h mean time to failure at 1,024 GPUs."""
RESTART_S = 300.0
"""Seconds a restart costs beside the redone work when none is measured: noticing the fault (a hang: the watchdog's
fault.hang_timeout_s), a new srun step, start-up and the checkpoint's load."""
ASSUMED_SAVE_S = 60.0
"""The save time assumed before a run has measured one (its metrics.jsonl ``checkpoint`` records)."""


def job_mtbf_h(gpus: int, gpu_hours_per_failure: float = GPU_HOURS_PER_FAILURE) -> float:
    """The job's mean time between failures in hours, at a constant failure rate per GPU."""
    return gpu_hours_per_failure / gpus


def young_daly_s(save_s: float, mtbf_s: float) -> float:
    """The checkpoint interval sqrt(2 x save time x MTBF), in seconds."""
    return math.sqrt(2 * save_s * mtbf_s)


def failure_cost_s(interval_s: float, restart_s: float = RESTART_S) -> float:
    """What one failure costs on average: half an interval of work redone, plus the restart."""
    return interval_s / 2 + restart_s


def overhead(interval_s: float, save_s: float, mtbf_s: float, restart_s: float = RESTART_S) -> float:
    """The fraction of the run lost to saving and to failures at this interval."""
    return save_s / interval_s + failure_cost_s(interval_s, restart_s) / mtbf_s


def measured_save_s(run_dir: str | Path) -> float | None:
    """The median save time of a run's checkpoints (metrics.jsonl's ``checkpoint`` records), None before any."""
    times = [r["save_s"] for r in read_records(run_dir, "checkpoint") if r.get("save_s") is not None]
    return statistics.median(times) if times else None


def advice(save_s: float, gpus: int, mtbf_h: float | None = None, restart_s: float = RESTART_S) -> dict:
    """The suggested ``checkpoint.every_minutes`` and what a failure costs, for a job of ``gpus`` GPUs."""
    mtbf_h = mtbf_h or job_mtbf_h(gpus)
    interval = young_daly_s(save_s, mtbf_h * 3600)
    cost = failure_cost_s(interval, restart_s)
    return {"every_minutes": interval / 60, "mtbf_h": mtbf_h, "save_s": save_s, "failure_cost_s": cost,
            "failure_gpu_hours": cost * gpus / 3600, "overhead": overhead(interval, save_s, mtbf_h * 3600, restart_s)}


def save_s_of(run_dir: str | Path) -> float:
    """The save time the advice uses: measured in the run folder, else ``ASSUMED_SAVE_S``."""
    measured = measured_save_s(run_dir)
    return measured if measured is not None else ASSUMED_SAVE_S


def every_minutes_of(setting: float | str | None, run_dir: str | Path, gpus: int,
                     mtbf_h: float | None = None) -> float | None:
    """The interval, in minutes, a run saves at by time: the recipe's ``checkpoint.every_minutes``, or for ``auto``
    the advice of :func:`advice_line` for the job's GPUs and the save time measured in its run folder (a requeue
    reads the saves of its earlier starts)."""
    if setting != "auto":
        return setting
    return advice(save_s_of(run_dir), gpus, mtbf_h)["every_minutes"]


def job_time(train_s: float, epochs: int, every_epochs: int | None, every_minutes: float | None, evals: int,
             eval_s: float, analysis_s: float, save_s: float) -> dict:
    """A job's wall-clock beside its steps (``train_s``): its ``evals`` evaluations of ``eval_s`` and per-epoch
    analyses of ``analysis_s`` (both run together), and its saves of ``save_s`` each (the time a save holds the
    step): one every ``every_epochs`` epochs, one once ``every_minutes`` passed since the last save (any save resets
    that clock), one at the end. Counts, seconds and each one's share of the whole."""
    epoch_s = (train_s + evals * (eval_s + analysis_s)) / max(epochs, 1)
    epoch_saves = epochs // every_epochs if every_epochs else 0
    between = epoch_s * (every_epochs or epochs)  # seconds between two epoch saves (the whole run without them)
    timed = math.floor(between / (every_minutes * 60)) * max(epoch_saves, 1) if every_minutes else 0
    saves = epoch_saves + timed + 1
    parts = {"train": train_s, "evaluation": evals * eval_s, "analysis": evals * analysis_s, "saves": saves * save_s}
    total = sum(parts.values())
    return {"saves": saves, "timed_saves": timed, "epoch_saves": epoch_saves, "evaluations": evals,
            "seconds": parts, "total_s": total, "share": {k: v / total for k, v in parts.items()}}


def advice_line(run_dir: str | Path, gpus: int, mtbf_h: float | None = None) -> str:
    """The one line of ``convit-scale plan``: the interval to set and what one failure costs."""
    measured = measured_save_s(run_dir)
    save_s = save_s_of(run_dir)
    a = advice(save_s, gpus, mtbf_h)
    source = (f"{save_s:.1f} s per save, measured in {run_dir}" if measured is not None else
              f"{save_s:.0f} s per save assumed (none measured yet in {run_dir})")
    mtbf = (f"MTBF {a['mtbf_h']:.2f} h" + ("" if mtbf_h else f" at {gpus} GPUs from 7.9 h at 1,024 (Meta's "
                                                               "clusters; --mtbf-hours sets yours)"))
    return (f"checkpoints: checkpoint.every_minutes={a['every_minutes']:.0f} (Young/Daly sqrt(2 x save x MTBF); "
            f"{source}, {mtbf}); one failure then costs about {a['failure_cost_s'] / 60:.0f} min "
            f"({a['failure_gpu_hours']:.1f} GPU-hours: half an interval redone plus {RESTART_S / 60:.0f} min to "
            f"restart); saving and failures take {a['overhead']:.1%} of the run")
