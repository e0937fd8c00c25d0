"""A trained model, for evaluation, analysis and export: a run checkpoint (DCP or DeepSpeed, consolidated without
any process group), an exported safetensors file, or published weights; and where a run keeps its checkpoints.

A run folder (``run.output_dir``) holds ``checkpoints/step_<N>/`` (complete once ``meta.json`` is in), ``latest``
(a text file naming the newest) and ``best/`` (the best evaluation's weights, fp32, and meta.json)."""

from __future__ import annotations

import json
import shutil
import sys
import tempfile
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

from .config import ModelConfig, model_options
from .errors import BadInput
from .files import atomic_path
from .models import MODELS, create_model, load_pretrained, read_state_dict
from .models.weights import timm_state_dict
from .runfolder import BEST, LATEST, META, PREFIX, checkpoint_problems, checkpoints, complete_checkpoints

__all__ = ["BEST", "LATEST", "PREFIX", "complete_checkpoints", "latest_checkpoint", "run_checkpoint", "consolidate",
           "export", "load_trained_model", "check_intact", "DamagedCheckpoint", "weights_metadata", "eval_view",
           "model_section", "newest_intact", "CHECKPOINTS", "EVAL_VIEW"]

EVAL_VIEW = ("eval_crop_ratio", "interpolation", "num_classes")
"""The recipe's data fields that decide what the evaluation sees: its pixels (resize to size / crop ratio, centre
crop) and its classes (the first ``num_classes`` labels)."""


def latest_checkpoint(root: Path) -> Path | None:
    found = complete_checkpoints(root)
    return found[-1] if found else None


class DamagedCheckpoint(BadInput, ValueError):
    """A checkpoint whose files do not match the listing in its meta.json."""


def check_intact(path: Path) -> None:
    """Refuse, in one line naming what differs, a checkpoint folder whose files do not match their listing."""
    problems = checkpoint_problems(path)
    if problems:
        more = f" (and {len(problems) - 2} more)" if len(problems) > 2 else ""
        raise DamagedCheckpoint(f"checkpoint {path} is damaged: {'; '.join(problems[:2])}{more}; allowed: an intact "
                                f"checkpoint (RUN or RUN:latest picks the newest intact one)")


def newest_intact(root: Path) -> Path | None:
    """The newest checkpoint of ``root`` whose files match their listing, saying on stderr which newer ones were
    passed over (read only: resume sets them aside)."""
    for path in reversed(complete_checkpoints(root)):
        problems = checkpoint_problems(path)
        if not problems:
            return path
        print(f"warning: checkpoint {path} is damaged ({problems[0]}): passed over for an older one", file=sys.stderr)
    return None


def run_checkpoint(spec: str | Path) -> Path:
    """The checkpoint a user names: a checkpoint folder or a file as they are; a run folder (with ``checkpoints/``)
    as its newest complete checkpoint; ``RUN:latest`` or ``RUN:best`` for the newest or the best evaluation's."""
    text = str(spec)
    run, sep, which = text.rpartition(":")
    if not (sep and which in (LATEST, BEST) and Path(run).is_dir()):
        run, which = text, None
    path = Path(run)
    root = checkpoints(path)
    if which is None and not root.is_dir():
        return path  # a checkpoint folder, an exported file or weights: load_trained_model says what it is
    if not root.is_dir():
        raise FileNotFoundError(f"{text}: {path} is not a run folder (no checkpoints/); allowed: RUN, RUN:latest, "
                                f"RUN:best for a run's output_dir, or {CHECKPOINTS}")
    if which == BEST:
        if not (root / BEST / META).is_file():
            raise FileNotFoundError(f"{text}: the run has no best checkpoint yet ({root / BEST}: written at the first "
                                    f"evaluation); allowed: {run}:latest")
        return root / BEST
    if latest_checkpoint(root) is None:
        raise FileNotFoundError(f"{text}: no complete checkpoint in {root} (none has meta.json yet)")
    newest = newest_intact(root)
    if newest is None:
        raise DamagedCheckpoint(f"{text}: no intact checkpoint in {root} (each differs from the listing in its "
                                f"meta.json); allowed: a run folder with an intact checkpoint")
    return newest


def weights_metadata(meta: dict) -> dict[str, str]:
    """What a weights file (``export``, ``best``) records of its run: the model config, the step, and how the run
    evaluated (``EVAL_VIEW``), so that ``eval`` and ``analyze`` see its images as the run did."""
    data = meta["config"].get("data", {})
    return {"model": json.dumps(meta["config"]["model"]), "step": str(meta["step"]),
            "eval_view": json.dumps({k: data[k] for k in EVAL_VIEW if k in data})}


def consolidate(checkpoint_dir: Path) -> dict[str, torch.Tensor]:
    """The full fp32 model state dict of a checkpoint, without any process group."""
    checkpoint_dir = Path(checkpoint_dir)
    if not (checkpoint_dir / META).is_file():
        raise FileNotFoundError(f"{checkpoint_dir}: not a complete checkpoint (no meta.json)")
    check_intact(checkpoint_dir)
    if (checkpoint_dir / "dcp").is_dir():
        with tempfile.TemporaryDirectory() as tmp:
            out = Path(tmp) / "full.pt"
            dcp_to_torch_save(str(checkpoint_dir / "dcp"), str(out))
            state = torch.load(out, map_location="cpu", weights_only=False)["model"]
    elif (checkpoint_dir / "model.safetensors").is_file():  # a run's best/ (the weights alone, consolidated)

        state = load_file(str(checkpoint_dir / "model.safetensors"))
    elif (checkpoint_dir / "zero").is_dir():
        from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

        state = get_fp32_state_dict_from_zero_checkpoint(str(checkpoint_dir), tag="zero")
    else:
        raise FileNotFoundError(f"{checkpoint_dir}: holds neither a DCP nor a DeepSpeed checkpoint")
    return {k: v.detach().float().contiguous() for k, v in state.items()}


def export(checkpoint_dir: Path, out: Path) -> Path:
    """Write ``out`` (.safetensors) with the model weights in timm's layout (:func:`timm_state_dict`: they load
    strictly into timm's ``convit_*``/``deit_*``) and the run's model config as metadata.

    Refused before any work: another suffix (``eval`` reads a file by its suffix) or an existing folder. On
    failure nothing is left behind: no temporary file, no folder this call created."""

    checkpoint_dir, out = Path(checkpoint_dir), Path(out)
    if not (checkpoint_dir / META).is_file():
        raise FileNotFoundError(f"{checkpoint_dir}: not a complete checkpoint (no meta.json)")
    if out.suffix != ".safetensors":
        raise BadInput(f"export --out {out}: export writes safetensors; allowed: a file name ending in .safetensors")
    if out.is_dir():
        raise BadInput(f"export --out {out} is an existing folder; allowed: a file name ending in .safetensors")
    state = timm_state_dict(consolidate(checkpoint_dir))
    meta = json.loads((checkpoint_dir / META).read_text())
    created = next((p for p in reversed(out.parents) if not p.exists()), None)  # the first folder made here
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        with atomic_path(out) as tmp:
            save_file(state, str(tmp), metadata=weights_metadata(meta))
    except BaseException:
        if created is not None:
            shutil.rmtree(created, ignore_errors=True)
        raise
    return out


CHECKPOINTS = "a run checkpoint folder (with meta.json), an exported .safetensors file, or a weights file"
"""What :func:`load_trained_model` reads, for error messages."""


def model_section(path: Path) -> dict | None:
    """The run's model config: from a checkpoint's meta.json or an exported file's metadata."""
    if not path.exists():
        raise FileNotFoundError(f"checkpoint not found: {path}; allowed: {CHECKPOINTS}")
    if path.is_dir():
        if not (path / META).is_file():
            raise FileNotFoundError(f"{path}: a folder but not a complete run checkpoint (no meta.json); "
                                    f"allowed: {CHECKPOINTS}")
        return json.loads((path / META).read_text())["config"]["model"]
    if path.suffix == ".safetensors":
        try:
            with safe_open(str(path), "pt") as f:
                meta = f.metadata() or {}
        except Exception as e:  # safetensors' own error types for a file that is not one
            raise BadInput(f"{path}: not a readable safetensors file ({type(e).__name__}); "
                           f"allowed: {CHECKPOINTS}") from e
        return json.loads(meta["model"]) if "model" in meta else None
    return None


def eval_view(path: str | Path) -> dict:
    """How the run evaluated (``eval_crop_ratio``, ``interpolation``), from a run checkpoint's meta.json or a weights
    file's metadata (``weights_metadata``); empty for published weights, which do not say (DeiT's view, 0.875 and
    bicubic, is then the default)."""
    path = Path(path)
    if path.is_dir() and (path / META).is_file():
        data = json.loads((path / META).read_text())["config"].get("data", {})
        return {k: data[k] for k in EVAL_VIEW if k in data}
    if path.is_file() and path.suffix == ".safetensors":
        try:
            with safe_open(str(path), "pt") as f:
                return json.loads((f.metadata() or {}).get("eval_view", "{}"))
        except Exception:  # noqa: BLE001 -- not a safetensors file: load_trained_model names it
            return {}
    return {}


def load_trained_model(path: str | Path, name: str | None = None, num_classes: int | None = None,
                       img_size: int | None = None):
    """A plain ConViT with the weights of a run checkpoint dir, an exported file or published weights; built at
    ``img_size`` when given (the position embedding resampled to its grid, as timm does), else at the run's."""

    path = Path(path)
    section = model_section(path)
    if section is None and name is None and path.is_file():
        read_state_dict(path)  # a file that holds no weights is named as such, before the missing model name
    if section is None and name is None:
        raise BadInput(f"{path}: weights without a model config (not an exported run checkpoint); "
                       f"pass the model name (--model)")
    m = ModelConfig(**{k: (tuple(v) if isinstance(v, list) else v) for k, v in (section or {}).items()})
    if name is not None:
        m.name = name
    state = consolidate(path) if path.is_dir() else read_state_dict(path)
    head = state["head.weight"].shape[0] if "head.weight" in state else None
    if num_classes is not None and head is not None and num_classes != head:
        raise BadInput(f"--num-classes {num_classes}: the weights in {path} have a head of {head} classes; allowed: "
                       f"{head}, or leave --num-classes out (the weights' own)")
    if num_classes is not None:
        m.num_classes = num_classes
    elif section is None and head is not None:  # weights alone: the classes of their head, at any --img-size
        m.num_classes = head
    if img_size is not None:
        spec = MODELS[m.name]
        patch, own = m.patch_size or spec.patch_size, m.img_size or spec.img_size
        if img_size % patch:
            raise BadInput(f"--img-size {img_size}: not a multiple of the model's patch size {patch}; allowed: a "
                           f"multiple of {patch} (the model's own: {own})")
        m.img_size = img_size
    opts = {**model_options(m), "drop_path_rate": 0.0}
    model = create_model(m.name, **opts)
    load_pretrained(model, state)
    return model.eval()
