"""DeiT's hard (and soft) distillation from a teacher of any timm architecture (Table 4).

The teacher runs in eval mode without gradients (bf16 on GPUs) on the same augmented batch as the
student, replicated on every rank: it is never wrapped by FSDP2/ZeRO, never in the optimizer, never in
the student's checkpoint. Its weights come from a local file, checked before training against the SHA-256 the
recipe pins (``distill.teacher_sha256``, whatever the file is called), key by key, and by its top-1 on validation
images (``distill.teacher_min_top1`` / ``teacher_max_top1``).
"""

from __future__ import annotations

import functools
import hashlib
import json
import math
import re
from pathlib import Path

import torch
from torch import nn

from ..config import Config, DistillConfig
from ..errors import BadInput
from ..evaluation import evaluate
from ..files import write_json_atomic
from ..models.weights import load_timm_model

HUB_NAME = re.compile(r"^.+-([0-9a-f]{8,64})\.(?:pth|pt|bin|safetensors)$")
"""torch.hub's naming of published weights: the file name ends with a prefix of its SHA-256 (DeiT's teacher is
regnety_160-a5fe301d.pth)."""

HASH_CACHE = ".teacher_sha256.json"
"""In the run's output folder: the teacher file's SHA-256 by (path, size, modification time), so that the ranks
and the restarts of a run hash the file once (preflight hashes it; 84M parameters are 0.3 GB read per rank)."""


@functools.lru_cache(maxsize=8)
def _sha256(path: str, size: int, mtime_ns: int) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 22), b""):
            h.update(block)
    return h.hexdigest()


def _file_key(path: Path) -> dict:
    st = path.stat()
    return {"path": str(path.resolve()), "size": st.st_size, "mtime_ns": st.st_mtime_ns}


def file_sha256(path: Path, cache_dir: Path | None) -> str:
    """The SHA-256 of ``path``, from ``cache_dir/HASH_CACHE`` when it names the same file at the same size and
    modification time, else computed (and kept in this process)."""
    key = _file_key(path)
    try:
        cached = json.loads((Path(cache_dir) / HASH_CACHE).read_text()) if cache_dir else {}
    except (OSError, ValueError):
        cached = {}
    if {k: cached.get(k) for k in key} == key and isinstance(cached.get("sha256"), str):
        return cached["sha256"]
    return _sha256(key["path"], key["size"], key["mtime_ns"])


def remember_sha256(path: Path, digest: str, cache_dir: Path) -> None:
    """Keep a checked teacher's hash in the run's folder (atomically: ranks may write at once)."""
    cache_dir = Path(cache_dir)
    cache_dir.mkdir(parents=True, exist_ok=True)
    write_json_atomic(cache_dir / HASH_CACHE, {**_file_key(path), "sha256": digest})


PINNED_TEACHER_HINT = ("Table 4's teacher is DeiT's RegNetY-16GF, https://dl.fbaipublicfiles.com/deit/"
                       "regnety_160-a5fe301d.pth, whatever the file is called here (timm's default regnety_160 "
                       "weights are another, stronger model); a copy converted to another format has another "
                       "hash: then set distill.teacher_sha256 to its own and keep the accuracy band "
                       "(distill.teacher_min_top1 / teacher_max_top1)")


def check_teacher_hash(d: DistillConfig, cache_dir: Path | None = None) -> str | None:
    """The teacher file's SHA-256 against ``distill.teacher_sha256`` (whatever the file's name) and against the
    prefix a torch.hub-style name carries; raises naming both hashes. Returns the digest (None: nothing pinned, not
    hashed; a missing file is left to the loader, which names it)."""
    path = Path(d.teacher_checkpoint)
    match = HUB_NAME.match(path.name)
    pins = ([(d.teacher_sha256, "distill.teacher_sha256")] if d.teacher_sha256 else []) + (
        [(match.group(1), f"the prefix its name carries ({path.name})")] if match else [])
    if not pins or not path.is_file():
        return None
    digest = file_sha256(path, cache_dir)
    for prefix, source in pins:
        if not digest.startswith(prefix):
            why = (PINNED_TEACHER_HINT if source == "distill.teacher_sha256" else
                   "the file is corrupt or another one; download it again")
            raise BadInput(f"distill.teacher_checkpoint {path}: its SHA-256 is {digest}, which does not start with "
                           f"{prefix}, {source}: {why}")
    return digest


def build_teacher(cfg: Config) -> nn.Module:
    """The teacher with its weights, on CPU, checked against its pinned SHA-256 (``check_teacher_hash``) and key by
    key (raises with the list of keys). Its hash is then kept in the run's folder for the other ranks and restarts."""
    d, out = cfg.distill, Path(cfg.run.output_dir)
    digest = check_teacher_hash(d, out)
    teacher = load_timm_model(d.teacher_model, d.teacher_checkpoint, num_classes=cfg.model.num_classes,
                              what=f"distill.teacher_checkpoint {d.teacher_checkpoint}",
                              name_key="distill.teacher_model")
    teacher.eval().requires_grad_(False)
    if digest is not None:
        remember_sha256(Path(d.teacher_checkpoint), digest, out)
    return teacher


def load_teacher(cfg: Config, device: torch.device) -> nn.Module:
    teacher = build_teacher(cfg).to(device)
    if device.type == "cuda" and cfg.parallel.precision != "fp32":
        teacher = teacher.to(torch.bfloat16)
    return teacher


TEACHER_CHECK_IMAGES = 5000
"""Validation images the teacher's accuracy band is measured on: the standard error of an 83% top-1 is then about
0.5 points (1.2 on 1,000), so a band a few points wide separates DeiT's teacher from a stronger one."""


def check_teacher(teacher: nn.Module, cfg: Config, loader, ctx, images: int = TEACHER_CHECK_IMAGES) -> None:
    """``distill.teacher_min_top1`` / ``teacher_max_top1``: the teacher's top-1 on up to ``images`` validation
    images, sharded over the ranks on the training device, before any training step, inside the band."""
    d = cfg.distill
    if d.teacher_min_top1 is None and d.teacher_max_top1 is None:
        return
    if loader is None:
        raise BadInput("distill.teacher_min_top1/teacher_max_top1 need validation data (data.val_path) to "
                       "evaluate the teacher")
    per_rank = math.ceil(images / (ctx.world_size * cfg.data.eval_batch_size))
    teacher.eval()
    dtype = next(teacher.parameters()).dtype
    found = evaluate(lambda x: teacher(x.to(dtype)), loader, ctx.device, max_batches=per_rank)
    low = -math.inf if d.teacher_min_top1 is None else d.teacher_min_top1
    high = math.inf if d.teacher_max_top1 is None else d.teacher_max_top1
    if ctx.is_main:
        print(f"[convit-scale] teacher {d.teacher_checkpoint}: top-1 {found['top1']:.2f} on {found['samples']} "
              f"validation images (distill.teacher_min_top1 = {low:g}, teacher_max_top1 = {high:g})", flush=True)
    if not low <= found["top1"] <= high:
        side = f"below distill.teacher_min_top1 = {low:g}" if found["top1"] < low else \
            f"above distill.teacher_max_top1 = {high:g}"
        raise BadInput(f"distill.teacher_checkpoint {d.teacher_checkpoint}: the teacher reaches {found['top1']:.2f}% "
                       f"top-1 on {found['samples']} validation images, {side}: wrong file or wrong architecture "
                       f"(Table 4 uses DeiT's regnety_160-a5fe301d.pth, 82.9%; timm's default regnety_160 weights "
                       f"are stronger)")
