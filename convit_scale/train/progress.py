"""What rank 0 shows of training: a rich progress bar on a terminal; elsewhere (a Slurm log, a file, a pipe) one
plain line per logged step, as timm, DeiT and torchtitan print them."""

from __future__ import annotations

import sys

from rich.progress import BarColumn, TextColumn, TimeElapsedColumn, TimeRemainingColumn
from rich.progress import Progress as RichProgress


def _duration(seconds: float) -> str:
    seconds = int(max(seconds, 0))
    hours, rest = divmod(seconds, 3600)
    return f"{hours}h{rest // 60:02d}m" if hours else f"{rest // 60}m{rest % 60:02d}s"


def step_line(rec: dict, total_steps: int) -> str:
    """A ``kind: train`` record of metrics.jsonl as one log line (step, epoch, loss, lr, images/s, step time, ETA,
    peak memory of the ranks, and the JPEGs the crop-region decoder, or the device's, refused so far)."""
    loss = "skipped (non-finite)" if rec["loss"] is None else f"{rec['loss']:.4f}"
    eta = _duration((total_steps - rec["step"]) * rec["step_time_s"])
    mem = max(rec["peak_mem_mb"]) if rec.get("peak_mem_mb") else 0.0
    norm = "" if rec.get("grad_norm") is None else f" | grad norm {rec['grad_norm']:.3g}"
    refused = rec.get("crop_decode_refused") or 0
    whole = f" | crop decoder refused {refused} JPEG(s) since the start" if refused else ""
    on_host = rec.get("device_decode_refused") or 0
    whole += f" | device decoder refused {on_host} JPEG(s), decoded on the host" if on_host else ""
    return (f"[convit-scale] step {rec['step']}/{total_steps} | epoch {rec['epoch']} | loss {loss} | lr "
            f"{rec['lr']:.3e} | {rec['images_per_s']:.0f} img/s | {rec['step_time_s']:.3f} s/step | eta {eta} | "
            f"mem {mem:.0f} MB{norm}{whole}")


class Progress:
    """``bar``: a rich bar (terminal); ``lines``: plain lines; neither on ranks other than 0."""

    def __init__(self, bar: bool, lines: bool, total: int, start: int):
        self.lines, self._bar, self._task = lines, None, None
        if bar:
            self._bar = RichProgress(TextColumn("[bold]{task.description}"), BarColumn(),
                                     TextColumn("{task.completed}/{task.total}"), TextColumn("{task.fields[info]}"),
                                     TimeElapsedColumn(), TimeRemainingColumn())
            self._task = self._bar.add_task("train", total=total, completed=start, info="")

    @classmethod
    def for_run(cls, is_main: bool, want_bar: bool, total: int, start: int) -> "Progress":
        bar = is_main and want_bar and sys.stdout.isatty()
        return cls(bar, is_main and not bar, total, start)

    def __enter__(self) -> "Progress":
        if self._bar is not None:
            self._bar.start()
        return self

    def __exit__(self, *exc) -> None:
        if self._bar is not None:
            self._bar.stop()

    def log_step(self, rec: dict, total_steps: int) -> None:
        if self.lines:
            print(step_line(rec, total_steps), flush=True)
        elif self._bar is not None:
            loss = "skipped" if rec["loss"] is None else f"{rec['loss']:.4f}"
            self._bar.update(self._task, info=f"loss {loss} lr {rec['lr']:.2e} {rec['images_per_s']:.0f} img/s")

    def advance(self, step: int) -> None:
        if self._bar is not None:
            self._bar.update(self._task, completed=step)
