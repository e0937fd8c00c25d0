"""A trained model, for evaluation, analysis and export: a run checkpoint (DCP or DeepSpeed, consolidated without
any process group), an exported safetensors file, or published weights."""

from __future__ import annotations

import json
import shutil
import tempfile
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

from .config import ModelConfig, model_options
from .files import atomic_path
from .models import create_model, load_pretrained, read_state_dict


def consolidate(checkpoint_dir: Path) -> dict[str, torch.Tensor]:
    """The full fp32 model state dict of a checkpoint, without any process group."""
    checkpoint_dir = Path(checkpoint_dir)
    if not (checkpoint_dir / "meta.json").is_file():
        raise FileNotFoundError(f"{checkpoint_dir}: not a complete checkpoint (no meta.json)")
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
    """Write ``out`` (.safetensors) with the model weights and the run's model config as metadata.

    Refused before any work: another suffix (``eval`` reads a file by its suffix) or an existing folder. On
    failure nothing is left behind: no temporary file, no folder this call created."""

    checkpoint_dir, out = Path(checkpoint_dir), Path(out)
    if not (checkpoint_dir / "meta.json").is_file():
        raise FileNotFoundError(f"{checkpoint_dir}: not a complete checkpoint (no meta.json)")
    if out.suffix != ".safetensors":
        raise ValueError(f"export --out {out}: export writes safetensors; allowed: a file name ending in .safetensors")
    if out.is_dir():
        raise ValueError(f"export --out {out} is an existing folder; allowed: a file name ending in .safetensors")
    state = consolidate(checkpoint_dir)
    meta = json.loads((checkpoint_dir / "meta.json").read_text())
    created = next((p for p in reversed(out.parents) if not p.exists()), None)  # the first folder made here
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        with atomic_path(out) as tmp:
            save_file(state, str(tmp), metadata={"model": json.dumps(meta["config"]["model"]),
                                                 "step": str(meta["step"])})
    except BaseException:
        if created is not None:
            shutil.rmtree(created, ignore_errors=True)
        raise
    return out


CHECKPOINTS = "a run checkpoint folder (with meta.json), an exported .safetensors file, or a weights file"
"""What :func:`load_trained_model` reads, for error messages."""


def _model_section(path: Path) -> dict | None:
    """The run's model config: from a checkpoint's meta.json or an exported file's metadata."""
    if not path.exists():
        raise FileNotFoundError(f"checkpoint not found: {path}; allowed: {CHECKPOINTS}")
    if path.is_dir():
        if not (path / "meta.json").is_file():
            raise FileNotFoundError(f"{path}: a folder but not a complete run checkpoint (no meta.json); "
                                    f"allowed: {CHECKPOINTS}")
        return json.loads((path / "meta.json").read_text())["config"]["model"]
    if path.suffix == ".safetensors":
        try:
            with safe_open(str(path), "pt") as f:
                meta = f.metadata() or {}
        except Exception as e:  # safetensors' own error types for a file that is not one
            raise ValueError(f"{path}: not a readable safetensors file ({type(e).__name__}); "
                             f"allowed: {CHECKPOINTS}") from e
        return json.loads(meta["model"]) if "model" in meta else None
    return None


def eval_view(path: str | Path) -> dict:
    """How the run evaluated (``eval_crop_ratio``, ``interpolation``), from a run checkpoint's meta.json; empty for
    files, whose metadata holds the model only (the analysis then uses DeiT's view, 0.875 and bicubic)."""
    path = Path(path)
    if not (path.is_dir() and (path / "meta.json").is_file()):
        return {}
    data = json.loads((path / "meta.json").read_text())["config"].get("data", {})
    return {k: data[k] for k in ("eval_crop_ratio", "interpolation") if k in data}


def load_trained_model(path: str | Path, name: str | None = None, num_classes: int | None = None):
    """A plain ConViT with the weights of a run checkpoint dir, an exported file or published weights."""

    path = Path(path)
    section = _model_section(path)
    state = None if path.is_dir() else read_state_dict(path)  # a file that holds no weights is named as such
    if section is None and name is None:
        raise ValueError(f"{path}: weights without a model config (not an exported run checkpoint); "
                         f"pass the model name (--model)")
    m = ModelConfig(**{k: (tuple(v) if isinstance(v, list) else v) for k, v in (section or {}).items()})
    if name is not None:
        m.name = name
    if num_classes is not None:
        m.num_classes = num_classes
    elif section is None and state is not None and "head.weight" in state:  # weights alone: classes of their head
        m.num_classes = state["head.weight"].shape[0]
    opts = {**model_options(m), "drop_path_rate": 0.0}
    model = create_model(m.name, **opts)
    load_pretrained(model, consolidate(path) if state is None else state)
    return model.eval()
