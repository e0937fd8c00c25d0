"""Where a run is: the counters the loop advances (saved in every checkpoint's meta.json) and the meters it reads
as it goes (never saved)."""

from __future__ import annotations

import time
from dataclasses import dataclass, field


@dataclass
class Meters:
    """What the loop measures on its way: the log clock, memory figures, the latest evaluation."""

    last_log_time: float = field(default_factory=time.time)
    images_since_log: int = 0
    steps_since_log: int = 0
    base_mem_mb: float | None = None
    """The process before the model (libraries, the process group)."""
    setup_peak_mem_mb: float | None = None
    """The peak of set-up (a whole model built before sharding, DeepSpeed's partitioning copies)."""
    state_mem_mb: list | None = None
    """Live tensors after backward per rank, once (``log.debug_memory``)."""
    teacher_checksum_start: float | None = None
    crop_counts_start: tuple[int, int] = (0, 0)
    """This process's crop-region decodes (boxes, refused) before the run's first step (``jpeg_roi.counts``)."""
    final: dict = field(default_factory=dict)
    """The latest evaluation (with the best so far), then the end of the run."""
    last_save_time: float = field(default_factory=time.monotonic)
    """When this process last saved (or started): checkpoint.every_minutes counts from it, on rank 0's clock."""
    retry_save: bool = False
    """A save written beside training failed and no save has been made at once since (the same on every rank): the
    next save point, or the first step after a good one, saves at once."""

    def log_due(self, every_seconds: float | None) -> bool:
        """Whether ``every_seconds`` have passed since the last log record, on this process's clock."""
        return every_seconds is not None and time.time() - self.last_log_time >= every_seconds

    def save_due(self, every_minutes: float | None) -> bool:
        """Whether ``every_minutes`` have passed since the last save, on this process's clock."""
        return every_minutes is not None and time.monotonic() - self.last_save_time >= 60 * every_minutes


@dataclass
class TrainState:
    step: int = 0
    """Optimizer steps taken, skipped ones included."""
    epoch: int = 0
    batch_in_epoch: int = 0
    """Micro-batches of this epoch already consumed on each rank (at a step's end: the step in the epoch x the
    accumulation)."""
    skipped_steps: int = 0
    """Steps discarded for a non-finite loss or gradient norm, over the whole run."""
    consecutive_bad: int = 0
    """Bad steps since the last good one: while > 0 the state followed a bad step, and no periodic
    checkpoint is written."""
    best: dict | None = None
    """The best evaluation so far: best_top1, best_top5, best_epoch (kept across resumes)."""
    meters: Meters = field(default_factory=Meters, compare=False)

    def record_eval(self, epoch: int, results: dict) -> dict:
        """``results`` with the best top-1/top-5 so far (and its epoch) added."""
        if self.best is None or results["top1"] > self.best["best_top1"]:
            self.best = {"best_top1": results["top1"], "best_top5": results["top5"], "best_epoch": epoch}
        return {**results, **self.best}

    def to_meta(self, accum: int, world_size: int) -> dict:
        return {"step": self.step, "epoch": self.epoch, "batch_in_epoch": self.batch_in_epoch,
                "step_in_epoch": self.batch_in_epoch // accum, "world_size": world_size,
                "skipped_steps": self.skipped_steps, "consecutive_bad": self.consecutive_bad, "best": self.best}

    @classmethod
    def from_meta(cls, meta: dict, accum: int, world_size: int) -> "TrainState":
        """The state a checkpoint recorded, on ``world_size`` ranks of ``accum`` micro-batches a step. The position in
        the epoch is global (the step in the epoch: the canonical layout makes it the same samples at any world
        size), so any world size continues at the same optimizer step."""
        return cls(step=meta["step"], epoch=meta["epoch"], skipped_steps=meta.get("skipped_steps", 0),
                   best=meta.get("best"), consecutive_bad=meta.get("consecutive_bad", 0),
                   batch_in_epoch=meta["step_in_epoch"] * accum)
