"""metrics.jsonl: the one writer (rank 0, optional TensorBoard beside it) and the one reader.

Each line is one record with a ``kind`` (train, eval, analysis, stopped, distill, end) and, except for
``end``, the optimizer ``step`` it belongs to.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

FILENAME = "metrics.jsonl"


def read_records(run_dir: str | Path, kind: str | None = None) -> list[dict]:
    """Every record of a run (of one ``kind`` when given), in the order written; [] without a file."""
    path = Path(run_dir) / FILENAME
    if not path.is_file():
        return []
    records = [r for r in map(_parse, path.read_text().splitlines()) if r is not None]
    return records if kind is None else [r for r in records if r.get("kind") == kind]


def _parse(line: str) -> dict | None:
    """One record; None for a blank line or one torn by a crash in the middle of a write."""
    try:
        return json.loads(line) if line.strip() else None
    except json.JSONDecodeError:
        return None


def truncate_after(run_dir: str | Path, step: int) -> None:
    """Drop the records of steps after ``step`` (a resume from that step's checkpoint logs them again), so that
    every step appears once after a crash and resume. Rewritten atomically."""
    path = Path(run_dir) / FILENAME
    if not path.is_file():
        return
    lines = [line for line in path.read_text().splitlines() if line.strip()]
    keep = [line for line in lines if (_parse(line) or {"step": math.inf}).get("step", 0) <= step]
    if len(keep) == len(lines):
        return
    tmp = path.with_name(FILENAME + ".tmp")
    tmp.write_text("".join(line + "\n" for line in keep))
    tmp.replace(path)


def _finite(value):
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_finite(v) for v in value]
    return value


class MetricsWriter:
    """metrics.jsonl (and optional TensorBoard) on rank 0; a no-op elsewhere. Numbers that are not finite are
    written as null: strict JSON readers refuse bare NaN/Infinity."""

    def __init__(self, out: Path, enabled: bool, tensorboard: bool, start_step: int | None = None):
        self.enabled = enabled
        if enabled and start_step is not None:
            truncate_after(out, start_step)
        self.file = open(Path(out) / FILENAME, "a") if enabled else None
        self.tb = None
        if enabled and tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            self.tb = SummaryWriter(str(Path(out) / "tensorboard"))

    def write(self, record: dict) -> None:
        if not self.enabled:
            return
        self.file.write(json.dumps(_finite(record), allow_nan=False) + "\n")
        self.file.flush()
        if self.tb is not None:
            step = record.get("step", 0)
            for k, v in record.items():
                if isinstance(v, (int, float)) and not isinstance(v, bool) and k != "step":
                    self.tb.add_scalar(f"{record['kind']}/{k}", v, step)
                elif isinstance(v, list) and v and all(isinstance(x, (int, float)) for x in v):  # per rank
                    for i, x in enumerate(v):
                        self.tb.add_scalar(f"{record['kind']}/{k}/{i}", x, step)
            self.tb.flush()

    def close(self) -> None:
        if self.file is not None:
            self.file.close()
        if self.tb is not None:
            self.tb.close()
