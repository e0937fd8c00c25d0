"""Loading published weights: the official ConViT checkpoints and timm's convit_* / deit_* state dicts; and
writing ours in timm's layout (``export``), so that both ways go through one rule (:func:`_positioned_tokens`).

Files are read without executing pickled code (``torch.load(weights_only=True)`` or safetensors).
A state dict that does not match the model key for key is refused with the list of keys; nothing is
half-loaded.
"""

from __future__ import annotations

from pathlib import Path

import timm
import torch
from safetensors.torch import load_file
from timm.layers import resample_abs_pos_embed

from ..errors import BadInput
from .convit import ConViT


class WeightsMismatch(BadInput, ValueError):
    """A state dict whose keys or shapes do not match the model."""

WEIGHTS_FILES = "a .safetensors file or a .pth/.pt/.bin state dict of tensors"
"""What :func:`read_state_dict` reads, for error messages."""


def _unreadable(e: BaseException) -> str:
    """Why torch.load(weights_only=True) refused a file, without torch's advice to load it unsafely."""
    for line in str(e).splitlines():
        if "Unsupported global:" in line:  # pickled Python objects that a weights-only load does not run
            return ("it pickles Python objects ("
                    + line.split("Unsupported global:", 1)[1].split(" was not")[0].strip().removeprefix("GLOBAL ")
                    + ")")
    text = str(e)
    if isinstance(e, (KeyError, EOFError)) or "weights_only" in text or "Weights only" in text:
        return "not a torch checkpoint"  # torch's own text advises an unsafe load: not relayed
    return f"{type(e).__name__}: {text}".splitlines()[0]


def read_state_dict(path: str | Path) -> dict[str, torch.Tensor]:
    """Read a ``.safetensors`` or ``.pth``/``.pt``/``.bin`` file into a flat state dict, safely."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"checkpoint file not found: {path}")
    if path.suffix == ".safetensors":
        try:
            return load_file(str(path))
        except Exception as e:  # safetensors raises its own error types for corrupt headers
            raise BadInput(f"{path}: not a readable safetensors file "
                           f"({str(e).splitlines()[0] if str(e) else type(e).__name__}); "
                           f"allowed: {WEIGHTS_FILES}") from e
    try:
        obj = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:
        raise BadInput(f"{path}: not a weights file ({_unreadable(e)}; a weights-only read runs no pickled code); "
                       f"allowed: {WEIGHTS_FILES}") from e
    # The official ConViT/DeiT releases wrap the weights: {"model": state_dict, ...}.
    for key in ("model", "state_dict", "module"):
        if isinstance(obj, dict) and key in obj and isinstance(obj[key], dict):
            obj = obj[key]
            break
    if not isinstance(obj, dict) or not all(isinstance(v, torch.Tensor) for v in obj.values()):
        raise BadInput(f"{path}: does not hold a state dict of tensors; allowed: {WEIGHTS_FILES}")
    return obj


def convert_state_dict(state_dict: dict[str, torch.Tensor], model: ConViT) -> dict[str, torch.Tensor]:
    """Map a published state dict onto our keys and shapes.

    - strips ``module.`` prefixes (DDP-saved files);
    - DeiT (timm VisionTransformer) puts position embeddings on the class/distillation tokens too:
      since our class token joins before block 0 in a DeiT, ``cls_token + pos_embed[:, 0]`` is exactly
      equivalent, so those positions are folded into the tokens;
    - a different grid (another resolution) is interpolated bicubically, as timm does.
    """
    sd = {k.removeprefix("module."): v for k, v in state_dict.items()}
    sd = {k: v for k, v in sd.items() if not k.endswith("attn.rel_indices")}  # derived, rebuilt here
    pos = sd.get("pos_embed")
    if pos is not None:
        tokens = _positioned_tokens(sd)
        # How many leading positions belong to class/distillation tokens: the rest is a square grid.
        n_prefix = next(c for c in (len(tokens), 0) if _is_square(pos.shape[1] - c))
        if n_prefix:
            if model.local_up_to_layer != 0:
                raise WeightsMismatch(
                    "position embedding covers class tokens (a DeiT checkpoint), but the model has "
                    f"{model.local_up_to_layer} GPSA layers: load it into a deit_* model"
                )
            for i, name in enumerate(tokens):
                sd[name] = sd[name] + pos[:, i : i + 1]
            pos = pos[:, n_prefix:]
        grid = model.grid_size
        if pos.shape[1] != grid * grid:
            pos = resample_abs_pos_embed(pos, new_size=[grid, grid], num_prefix_tokens=0)
        sd["pos_embed"] = pos
    return sd


def _positioned_tokens(sd: dict[str, torch.Tensor]) -> tuple[str, ...]:
    """The tokens to which timm's DeiT (``VisionTransformer``, ``VisionTransformerDistilled``) gives a position
    row, in the order of those rows (its ``pos_embed`` is (1, tokens + grid, D)); ours are position-free, which
    is the same model since a DeiT's tokens join before block 0 (timm's ConViT, like ours, has none)."""
    return ("cls_token", "dist_token") if "dist_token" in sd else ("cls_token",)


def timm_state_dict(sd: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Our state dict in the layout timm builds for the same model: the inverse of :func:`convert_state_dict`.

    A ConViT's keys are timm's ``convit_*`` already. A DeiT (no GPSA layer) gets a zero position row for each
    token of :func:`_positioned_tokens`, so that it loads strictly into timm's ``deit_*`` (``pos_embed`` of
    197 rows at 224 pixels) and computes the same logits; :func:`convert_state_dict` folds them back (adding zero).
    """
    pos = sd.get("pos_embed")
    if pos is None or any(k.endswith("attn.gating_param") for k in sd):
        return dict(sd)
    rows = pos.new_zeros(pos.shape[0], len(_positioned_tokens(sd)), pos.shape[2])
    return {**sd, "pos_embed": torch.cat((rows, pos), dim=1)}


def _is_square(n: int) -> bool:
    return n >= 0 and round(n**0.5) ** 2 == n


def _first(items: list[str], sep: str, n: int = 8) -> str:
    """The first ``n`` items: a wrong architecture's hundreds of keys would bury the line."""
    return sep.join(items[:n]) + (f"{sep}... ({len(items) - n} more)" if len(items) > n else "")


def check_state_dict(sd: dict[str, torch.Tensor], model: torch.nn.Module, what: str = "state dict") -> None:
    """Raise ``WeightsMismatch`` naming every missing, unexpected or mis-shaped key."""
    expected = model.state_dict()
    missing = sorted(set(expected) - set(sd))
    unexpected = sorted(set(sd) - set(expected))
    shapes = sorted(
        f"{k}: file {tuple(sd[k].shape)} vs model {tuple(expected[k].shape)}"
        for k in set(sd) & set(expected)
        if tuple(sd[k].shape) != tuple(expected[k].shape)
    )
    if missing or unexpected or shapes:
        parts = []
        if missing:
            parts.append(f"missing keys ({len(missing)}): {_first(missing, ', ')}")
        if unexpected:
            parts.append(f"unexpected keys ({len(unexpected)}): {_first(unexpected, ', ')}")
        if shapes:
            parts.append(f"shape mismatches ({len(shapes)}): {_first(shapes, '; ')}")
        raise WeightsMismatch(f"{what} does not match the model: " + " | ".join(parts))


def load_pretrained(model: ConViT, source: str | Path | dict[str, torch.Tensor]) -> ConViT:
    """Load published weights (a file or a state dict) into ``model``, all keys or nothing."""
    what = str(source) if not isinstance(source, dict) else "state dict"
    sd = read_state_dict(source) if not isinstance(source, dict) else source
    sd = convert_state_dict(sd, model)
    check_state_dict(sd, model, what)
    model.load_state_dict(sd, strict=True)
    return model


def load_timm_model(name: str, path: str | Path, num_classes: int | None = None, what: str | None = None,
                    name_key: str = "model") -> torch.nn.Module:
    """A timm architecture (e.g. a distillation teacher) with its weights from a local file, strictly.

    Created with ``pretrained=False`` (nothing is downloaded), the file read without executing pickled code
    (:func:`read_state_dict`), checked key by key (:func:`check_state_dict`, ``what`` names the file in the
    error) and loaded with ``strict=True``. ``name_key`` names the setting in the error for an unknown name.
    """

    kwargs = {} if num_classes is None else {"num_classes": num_classes}
    try:
        model = timm.create_model(name, pretrained=False, **kwargs)
    except RuntimeError as e:  # timm: unknown model
        raise BadInput(f"{name_key} = {name!r}: {e}") from e
    state = read_state_dict(path)
    check_state_dict(state, model, what or str(path))
    model.load_state_dict(state, strict=True)
    return model
