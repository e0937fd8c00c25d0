"""Consolidate a sharded run checkpoint (DCP or DeepSpeed) into one plain state dict / safetensors file."""

from __future__ import annotations

import json
import tempfile
from pathlib import Path

import torch


def consolidate(checkpoint_dir: Path) -> dict[str, torch.Tensor]:
    """The full fp32 model state dict of a checkpoint, without any process group."""
    checkpoint_dir = Path(checkpoint_dir)
    if not (checkpoint_dir / "meta.json").is_file():
        raise FileNotFoundError(f"{checkpoint_dir}: not a complete checkpoint (no meta.json)")
    if (checkpoint_dir / "dcp").is_dir():
        from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

        with tempfile.TemporaryDirectory() as tmp:
            out = Path(tmp) / "full.pt"
            dcp_to_torch_save(str(checkpoint_dir / "dcp"), str(out))
            state = torch.load(out, map_location="cpu", weights_only=False)["model"]
    elif (checkpoint_dir / "zero").is_dir():
        from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

        state = get_fp32_state_dict_from_zero_checkpoint(str(checkpoint_dir), tag="zero")
    else:
        raise FileNotFoundError(f"{checkpoint_dir}: holds neither a DCP nor a DeepSpeed checkpoint")
    return {k: v.detach().float().contiguous() for k, v in state.items()}


def export(checkpoint_dir: Path, out: Path) -> Path:
    """Write ``out`` (.safetensors) with the model weights and the run's model config as metadata."""
    from safetensors.torch import save_file

    state = consolidate(checkpoint_dir)
    meta = json.loads((Path(checkpoint_dir) / "meta.json").read_text())
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(out.name + ".tmp")
    save_file(state, str(tmp), metadata={"model": json.dumps(meta["config"]["model"]), "step": str(meta["step"])})
    tmp.replace(out)
    return out


def _model_section(path: Path) -> dict | None:
    """The run's model config: from a checkpoint's meta.json or an exported file's metadata."""
    if path.is_dir():
        return json.loads((path / "meta.json").read_text())["config"]["model"]
    if path.suffix == ".safetensors":
        from safetensors import safe_open

        with safe_open(str(path), "pt") as f:
            meta = f.metadata() or {}
        return json.loads(meta["model"]) if "model" in meta else None
    return None


def load_trained_model(path: str | Path, name: str | None = None, num_classes: int | None = None):
    """A plain ConViT with the weights of a run checkpoint dir, an exported file or published weights."""
    from ..config import ModelConfig, model_options
    from ..models import create_model, load_pretrained, read_state_dict

    path = Path(path)
    section = _model_section(path)
    if section is None and name is None:
        raise ValueError(f"{path}: holds no model config; pass the model name (--model)")
    m = ModelConfig(**{k: (tuple(v) if isinstance(v, list) else v) for k, v in (section or {}).items()})
    if name is not None:
        m.name = name
    if num_classes is not None:
        m.num_classes = num_classes
    opts = {**model_options(m), "drop_path_rate": 0.0}
    model = create_model(m.name, **opts)
    load_pretrained(model, consolidate(path) if path.is_dir() else read_state_dict(path))
    return model.eval()
