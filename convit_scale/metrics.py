"""metrics.jsonl: the one writer (rank 0, optional TensorBoard and Weights & Biases beside it) and the one reader.

Each line is one record with a ``kind`` (train, eval, analysis, stopped, distill, end) and, except for
``end``, the optimizer ``step`` it belongs to. TensorBoard and W&B get each record's numbers as ``kind/key``
(``kind/key/i`` for a list of one number per rank) at the record's step.
"""

from __future__ import annotations

import json
import math
import netrc
import os
import secrets
import socket
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlparse

from .errors import BadInput
from .files import write_atomic
from .runfolder import METRICS

FILENAME = METRICS
WANDB_ID_FILE = "wandb_run_id"
"""In the run folder: the W&B run id, so that a resumed run (a requeue) continues the same W&B run."""


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
    write_atomic(path, "".join(line + "\n" for line in keep))


def _finite(value):
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_finite(v) for v in value]
    return value


def scalars(record: dict) -> dict[str, float]:
    """The numbers of a record as ``kind/key`` (``kind/key/i`` per rank): what TensorBoard and W&B get."""
    found = {}
    number = lambda x: isinstance(x, (int, float)) and not isinstance(x, bool)  # noqa: E731
    for k, v in record.items():
        if number(v) and k != "step":
            found[f"{record['kind']}/{k}"] = v
        elif isinstance(v, list) and v and all(number(x) for x in v):  # one per rank
            found.update({f"{record['kind']}/{k}/{i}": x for i, x in enumerate(v)})
    return found


@dataclass(frozen=True)
class WandbOptions:
    """A run's W&B settings (``wandb_options`` builds them from the recipe)."""
    project: str
    entity: str | None
    name: str
    mode: str
    """auto, online or offline (log.wandb_mode)."""
    config: dict
    """The resolved recipe: the W&B run's config."""

def wandb_options(log, output_dir: str, config: dict) -> WandbOptions | None:
    """From the recipe's ``log`` section (LogConfig), its ``run.output_dir`` and the resolved recipe as a dict;
    None when ``log.wandb`` is off."""
    if not log.wandb:
        return None
    return WandbOptions(log.wandb_project, log.wandb_entity, log.wandb_name or run_name(output_dir), log.wandb_mode,
                        config)


def run_name(output_dir: str) -> str:
    """A run's name from its folder: the path below the last ``runs`` folder (runs/table1/convit_small ->
    table1/convit_small), else the folder's own name."""
    parts = Path(output_dir).parts
    below = parts[len(parts) - parts[::-1].index("runs"):] if "runs" in parts else ()
    return "/".join(below) if below else Path(output_dir).resolve().name


def check_log_backends(log) -> None:
    """Refuse, before any process starts, a recipe whose ``log`` section (LogConfig) asks for TensorBoard or W&B
    where that package is not installed."""
    for wanted, module, package in ((log.tensorboard, "tensorboard", "tensorboard"), (log.wandb, "wandb", "wandb")):
        if not wanted:
            continue
        try:
            __import__(module)
        except ImportError as e:
            raise BadInput(f"log.{module} = true needs the {package} package: pip install {package} (or set "
                           f"log.{module}=false)") from e


def wandb_mode(requested: str) -> tuple[str, str]:
    """(online | offline | what WANDB_MODE says, why) for ``log.wandb_mode``. auto: the environment's WANDB_MODE
    when set; else offline without an API key or when W&B's server does not answer within 5 s (a cluster's
    compute nodes often have no route out), else online."""

    if requested != "auto":
        return requested, f"log.wandb_mode = {requested}"
    if os.environ.get("WANDB_MODE"):
        return os.environ["WANDB_MODE"], "WANDB_MODE in the environment"
    url = urlparse(os.environ.get("WANDB_BASE_URL", "https://api.wandb.ai"))
    host, port = url.hostname or "api.wandb.ai", url.port or (80 if url.scheme == "http" else 443)
    try:
        key = os.environ.get("WANDB_API_KEY") or (netrc.netrc().authenticators(host) or (None, None, None))[2]
    except (OSError, netrc.NetrcParseError):
        key = None
    if not key:
        return "offline", f"no API key for {host} (WANDB_API_KEY or `wandb login`)"
    try:
        socket.create_connection((host, port), timeout=5).close()
    except OSError as e:
        return "offline", f"{host}:{port} does not answer ({e.__class__.__name__})"
    return "online", f"{host} answers"


class _WandbRun:
    """One W&B run per run folder: its id is kept in the folder, so a resumed run continues it; a fresh start
    (step 0) is a new W&B run. Steps W&B already has (a resume re-logs the steps after its checkpoint, with the
    same values: resume is exact) are not sent again."""

    def __init__(self, out: Path, opts: WandbOptions, fresh: bool):
        import wandb

        mode, why = wandb_mode(opts.mode)
        id_file = out / WANDB_ID_FILE
        if fresh or not id_file.is_file():
            id_file.write_text(secrets.token_hex(4) + "\n")  # W&B ids: letters and digits
        run_id = id_file.read_text().strip()
        self.run = wandb.init(project=opts.project, entity=opts.entity, name=opts.name, id=run_id, resume="allow",
                              dir=str(out), mode=mode, config=opts.config, settings=wandb.Settings(console="off"))
        self.step = 0
        self.first_new_step = self.run.step  # W&B's next step: 0 for a new run; asked once (a round trip)
        where = (f"; upload it later with `wandb sync {self.run.dir.rsplit('/files', 1)[0]}`" if mode == "offline"
                 else "")
        print(f"[convit-scale] W&B {mode} ({why}): run {opts.name} ({run_id}) in project {opts.project}{where}",
              flush=True)

    def log(self, record: dict) -> None:
        self.step = record.get("step", self.step)
        values = {k: v for k, v in scalars(record).items() if v is not None}
        if values and self.step >= self.first_new_step:
            self.run.log(values, step=self.step)

    def close(self) -> None:
        import wandb

        self.run.finish()
        # finish() returns before W&B's service has written the run's .wandb file (every 15 s, and at its exit):
        # an offline run whose process ended right after it was found empty. teardown() waits for the service.
        wandb.teardown()


class MetricsWriter:
    """metrics.jsonl (and optional TensorBoard and W&B) on rank 0; a no-op elsewhere. Numbers that are not finite
    are written as null (strict JSON readers refuse bare NaN/Infinity) and not sent to W&B."""

    def __init__(self, out: Path, enabled: bool, tensorboard: bool, start_step: int | None = None,
                 wandb: WandbOptions | None = None):
        self.enabled = enabled
        if enabled and start_step is not None:
            truncate_after(out, start_step)
        self.file = open(Path(out) / FILENAME, "a") if enabled else None
        self.tb = self.wandb = None
        if enabled and tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            self.tb = SummaryWriter(str(Path(out) / "tensorboard"))
        if enabled and wandb is not None:
            self.wandb = _WandbRun(Path(out), wandb, fresh=not start_step)

    def write(self, record: dict) -> None:
        if not self.enabled:
            return
        finite = _finite(record)
        self.file.write(json.dumps(finite, allow_nan=False) + "\n")
        self.file.flush()
        if self.tb is not None:
            for key, value in scalars(record).items():
                self.tb.add_scalar(key, value, record.get("step", 0))
            self.tb.flush()
        if self.wandb is not None:
            self.wandb.log(finite)

    def close(self) -> None:
        if self.file is not None:
            self.file.close()
        if self.tb is not None:
            self.tb.close()
        if self.wandb is not None:
            self.wandb.close()
