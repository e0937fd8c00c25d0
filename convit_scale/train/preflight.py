"""The checks a run passes before any process starts (``preflight``): each refusal is one line naming the key and
what is allowed, and nothing is written before them.

Cheap by design (manifest.json and file sizes, no image is read), and run once: by the launching process
(``convit-scale train``, the demo, ``launch.run_recipe``), or by rank 0 when torchrun, srun or accelerate start
the ranks directly (``python -m convit_scale.train --recipe``).
"""

from __future__ import annotations

import json
import math
import subprocess
import tempfile
import urllib.request
from pathlib import Path

from .. import jpeg_roi
from ..config import Config, model_options
from ..data import DataError, Manifest
from ..data.imagefolder import imagefolder_samples
from ..errors import BadInput
from ..imagetree import PrepError, list_classes
from ..manifest import MANIFEST
from ..metrics import check_log_backends
from ..models import create_model, read_state_dict
from ..models.weights import check_state_dict, convert_state_dict
from ..runfolder import check_lease, checkpoint_problems, checkpoints, complete_checkpoints
from .checkpoint import check_compatible, read_meta, resume_source
from .distill import build_teacher

PROBE_TIMEOUT_S = 10
"""How long preflight waits for a remote WebDataset location's manifest.json before refusing the URL."""


def preflight(cfg: Config) -> None:
    """Checks that must pass before any worker process starts, each one line naming the key and what is allowed.

    Cheap by design (manifest.json and file sizes, no image is read): the output folder can be written; the data
    exists in the recipe's format, holds at least one global batch and no more classes than the model has, and
    every file the manifest lists is there at its recorded size; a remote location answers; ``model.pretrained``
    matches the model key for key (on the meta device); a checkpoint to resume was written by the same model,
    strategy and global batch; the teacher loads; no other training holds the folder's lease (runfolder.py)."""
    _check_output_dir(cfg.run.output_dir)
    check_lease(Path(cfg.run.output_dir), cfg.fault.hang_timeout_s)  # FolderHeld: another training writes there
    check_data(cfg)
    check_log_backends(cfg.log)  # log.tensorboard / log.wandb without their package
    refused = jpeg_roi.refusal(cfg.data.format, cfg.data.decode_on, cfg.data.whole_jpeg_decode)
    if refused:
        raise BadInput(refused)
    if cfg.model.pretrained:
        _check_pretrained(cfg.model)
    _check_resume(cfg)
    if cfg.distill.enabled:
        build_teacher(cfg)


DATA_FORMS = {"ffcv": "a folder that `convit-scale prep ffcv` wrote (manifest.json), or .ffcv/.beton files",
              "wds": "a folder that `convit-scale prep wds` wrote (manifest.json), or shards with timm's _info.json",
              "imagefolder": "an ImageFolder root with train/ and val/ folders of class folders"}
"""What each data.format reads, as refusals name it."""


def check_data(cfg: Config) -> None:
    """The data part of :func:`preflight` (also ``config --check-data``, slurm/launch.sh's check before srun): the
    train and val locations exist, and their manifest (or listing) fits the recipe."""
    d = cfg.data
    for key in ("train_path", "val_path"):
        loc = getattr(d, key)
        if key == "train_path" and not loc:
            raise DataError("data.train_path is empty: point it at prepared shards or an ImageFolder tree")
        if loc and "{name}" not in loc and not Path(loc).exists():
            raise DataError(f"data.{key}: {loc} does not exist")
    for split, key in (("train", "train_path"), ("val", "val_path")):
        if getattr(d, key):
            _check_data(cfg, split, key, getattr(d, key))


def _check_output_dir(output_dir: str) -> None:
    """run.output_dir is a folder, or can be made one, and a file can be written in it (or its first existing
    parent): nothing is created here."""
    out = Path(output_dir)
    allowed = "allowed: a folder that can be created and written"
    existing = next(p for p in (out, *out.parents) if p.exists() or p == Path(p.anchor or "."))
    if not existing.is_dir():
        raise BadInput(f"run.output_dir = {output_dir}: {existing} is a file, not a folder; {allowed}")
    try:
        with tempfile.TemporaryFile(dir=existing):  # unnamed, gone when closed
            pass
    except OSError as e:
        raise BadInput(f"run.output_dir = {output_dir}: cannot write in {existing} ({e.strerror}); {allowed}") from e


def _probe_remote(key: str, loc: str) -> Manifest:
    """A remote WebDataset location's manifest.json within PROBE_TIMEOUT_S: a wrong URL is one line now, not a
    minute of silence per rank later."""
    url = loc.format(name=MANIFEST)
    try:
        if url.startswith("pipe:"):
            res = subprocess.run(url[len("pipe:"):], shell=True, capture_output=True, timeout=PROBE_TIMEOUT_S)
            if res.returncode != 0:
                why = (res.stderr.decode(errors="replace").strip().splitlines() or [f"exit status {res.returncode}"])
                raise DataError(f"data.{key}: {url} failed ({why[-1]}); allowed: a location whose manifest.json reads")
            data = res.stdout
        elif url.startswith(("http://", "https://")):
            with urllib.request.urlopen(url, timeout=PROBE_TIMEOUT_S) as f:
                data = f.read()
        else:
            return Manifest.read(loc)
        return Manifest.from_dict(json.loads(data), loc)
    except subprocess.TimeoutExpired as e:
        raise DataError(f"data.{key}: {url} gave no answer within {PROBE_TIMEOUT_S} s; allowed: a reachable "
                        f"location of prepared shards") from e
    except (OSError, ValueError) as e:  # URLError, a timeout, JSON that is not
        raise DataError(f"data.{key}: {url} is not readable ({getattr(e, 'reason', e)}); allowed: a reachable "
                        f"location of prepared shards with manifest.json") from e


def _check_data(cfg, split: str, key: str, loc: str) -> None:
    """The data of one split against the recipe, from manifest.json and file sizes (ImageFolder: the listing)."""
    d, model = cfg.data, cfg.model
    if d.format == "imagefolder":
        root = Path(loc)
        if not (root / split).is_dir():
            held = (" (it holds a prepared dataset: set data.format to the manifest's format)"
                    if (root / "manifest.json").is_file() else "")
            raise DataError(f"data.{key}: no {split} folder in {root}{held}; allowed: an ImageFolder root with "
                            f"train/ and val/")
        try:
            n_classes = len(list_classes(root / "train"))
            n = len(imagefolder_samples(root, split, d.subset_fraction, d.num_classes)) if split == "train" else None
        except PrepError as e:
            raise DataError(f"data.{key}: {e}") from e
    else:
        remote = "{name}" in loc
        manifest = _probe_remote(key, loc) if remote else Manifest.read(loc, d.ffcv_fields)
        found = manifest.format
        if found != d.format:
            raise DataError(f"data.{key}: {loc} holds {found} data (manifest.json), data.format = {d.format!r}; "
                            f"allowed: data.format = {found!r}, or {d.format} data made by "
                            f"`convit-scale prep {d.format}`")
        try:
            info, n_classes = manifest.split(split), manifest.num_classes
            if d.format == "wds":
                manifest.require_classes(d.num_classes)
            if split == "train" and d.format == "wds":
                manifest.require_subset(d.subset_fraction)
            elif split == "train" and d.format == "ffcv":
                manifest.require_whole(d.subset_fraction)
        except DataError as e:
            raise DataError(f"data.{key}: {e}") from e
        if split == "train" and d.format == "ffcv":  # the subset is taken at load time: first files of each class
            n = sum(math.floor(c * d.subset_fraction) for k, c in info.per_class.items()
                    if d.num_classes is None or int(k) < d.num_classes)
        else:
            n = info.num_samples if split == "train" else None
        for name, rec in ([] if remote else info.files.items()):
            path = manifest.folder / name
            if not path.is_file():
                raise DataError(f"data.{key}: {path} is missing (listed in manifest.json); allowed: the complete "
                                f"output of `convit-scale prep` (run it again to finish it)")
            size, recorded = path.stat().st_size, rec.get("bytes")
            if recorded is not None and size != recorded:
                raise DataError(f"data.{key}: {path} has {size} bytes, manifest.json records {recorded} (truncated or "
                                f"changed); allowed: the file prep wrote (check with `convit-scale prep verify {loc}`)")
    if d.num_classes is not None:
        n_classes = min(n_classes, d.num_classes)
    if n_classes > model.num_classes:
        raise DataError(f"model.num_classes = {model.num_classes} is below the {n_classes} classes of {loc}; allowed: "
                        f">= {n_classes}")
    if n is not None and n < d.global_batch_size:
        raise DataError(f"data.{key}: {loc} holds {n} training images (subset_fraction {d.subset_fraction:g}), fewer "
                        f"than data.global_batch_size = {d.global_batch_size}: no optimizer step fits in an epoch; "
                        f"allowed: data.global_batch_size <= {n}")


def _check_pretrained(m) -> None:
    """model.pretrained holds the model's keys and shapes, checked against a model on the meta device."""
    model = create_model(m.name, device="meta", **model_options(m))
    sd = convert_state_dict(read_state_dict(m.pretrained), model)
    check_state_dict(sd, model, f"model.pretrained {m.pretrained} ({m.name})")


def _check_resume(cfg) -> None:
    """The checkpoint that ``checkpoint.resume`` picks (``checkpoint.resume_source``: a run continues from its own
    newest checkpoint once it has one) was written by this run's recipe: the same rules the engine applies, here
    before any process starts or anything is written."""
    root = checkpoints(cfg.run.output_dir)
    sound = [p for p in complete_checkpoints(root) if not checkpoint_problems(p, checksums=False)]
    path, _ = resume_source(root, cfg.checkpoint.resume, sound[-1] if sound else None)
    if path is not None and not checkpoint_problems(path, checksums=False):  # the ranks refuse a damaged one
        check_compatible(path, read_meta(path), cfg.to_dict())
