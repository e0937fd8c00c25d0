"""`convit-scale analyze`: every measurement of the paper's Section 4 (and of Raghu et al. 2021) for a checkpoint, as PNGs and one JSON.

Inputs: a run checkpoint directory, an exported .safetensors or published weights; optionally a second
model to compare (CKA between models); optionally the run folder for the histories over training.
"""

from __future__ import annotations

import contextlib
import json
from pathlib import Path

import torch

from ..models.convit import GPSA, ConViT
from .cka import MinibatchCKA
from ..metrics import read_records
from ..evaluation import Batches, evaluate
from .attention import attention_maps, gating, head_distances
from . import ANALYSIS_IMAGES  # noqa: F401  (re-exported: the default number of images)


def eval_batches(data: str, fmt: str, img_size: int, images: int, batch_size: int = 32, **view) -> list:
    """The first ``images`` validation images (eval transform, fewer if the split is smaller) as batches of
    ``batch_size``, kept in host memory for every analysis (1,024 images at 224 are 0.6 GB). ``view``: the run's
    ``eval_crop_ratio`` and ``interpolation`` (``trained.eval_view``), so that the analysis sees the images as
    the run's evaluation did; DeiT's (0.875, bicubic) otherwise."""
    from ..config import DataConfig
    from ..data import LoaderSpec, build_loader

    d = DataConfig(format=fmt, train_path=data, val_path=data, num_workers=0, **view)
    loader = build_loader(d, LoaderSpec("val", img_size, batch_size))
    batches, seen = [], 0
    for x, y in loader.epoch(0):
        n = min(len(y), images - seen, loader.num_real - seen)  # padding of the last batch is not an image
        if n <= 0:
            break
        batches.append((x[:n], y[:n]))
        seen += n
    return batches


@contextlib.contextmanager
def masked(model: ConViT, pos_embed: bool = False, content_layers: int = 0, position_layers: int = 0):
    """The paper's test-time masking: position embedding zeroed (Table 5); content or positional
    attention masked in the first k GPSA layers (Table 6)."""
    saved = model.pos_embed.detach().clone()
    gpsa = [b.attn for b in model.blocks if isinstance(b.attn, GPSA)]
    try:
        if pos_embed:
            with torch.no_grad():
                model.pos_embed.zero_()
        for i, attn in enumerate(gpsa):
            attn.mask = "content" if i < content_layers else ("position" if i < position_layers else None)
        yield model
    finally:
        with torch.no_grad():
            model.pos_embed.copy_(saved)
        for attn in gpsa:
            attn.mask = None


def _device_of(model: torch.nn.Module) -> torch.device:
    return next(model.parameters()).device


@torch.no_grad()
def accuracy(model: ConViT, batches: list[tuple[torch.Tensor, torch.Tensor]]) -> float:
    """Top-1 in percent over ``batches`` (the counter training's evaluation uses), on the model's device."""
    model.eval()
    return evaluate(model, Batches(batches), _device_of(model))["top1"]


def masking_table(model: ConViT, batches) -> dict:
    """Accuracy with each masking of Tables 5 and 6 (k = all GPSA layers and k = half of them)."""
    n_gpsa = len(model.gpsa_blocks())
    table = {"none": accuracy(model, batches)}
    with masked(model, pos_embed=True):
        table["position_embedding"] = accuracy(model, batches)
    for k in sorted({max(1, n_gpsa // 2), n_gpsa} - {0}):
        with masked(model, content_layers=k):
            table[f"content_attention_first_{k}"] = accuracy(model, batches)
        with masked(model, position_layers=k):
            table[f"position_attention_first_{k}"] = accuracy(model, batches)
    return table


@torch.no_grad()
def layer_representations(model: ConViT, x: torch.Tensor) -> list[torch.Tensor]:
    model.eval()
    return model.forward_features(x.to(_device_of(model), non_blocking=True), return_layers=True)[1]


@torch.no_grad()
def cka_matrix(a: ConViT, b: ConViT, batches) -> torch.Tensor:
    acc = MinibatchCKA(len(a.blocks), len(b.blocks))
    for x, _ in batches:
        acc.update(layer_representations(a, x), layer_representations(b, x))
    return acc.compute()


def history(run_dir: Path) -> dict:
    """Gating and nonlocality over training, from a run's metrics.jsonl."""
    recs = read_records(run_dir, "analysis")
    return {"epoch": [r["epoch"] for r in recs], "gating": [r["gating"] for r in recs],
            "nonlocality": [r["nonlocality"] for r in recs]}


def analyze(model: ConViT, batches, out: Path, compare: ConViT | None = None, run_dir: Path | None = None,
            names: tuple[str, str] = ("model", "compare"), query_patch: int | None = None) -> dict:
    """Compute everything on the models' device over every image of ``batches`` (host tensors, moved one batch
    at a time), write the plots and ``analysis.json`` into ``out``; returns the numbers."""
    from . import plots

    out.mkdir(parents=True, exist_ok=True)
    model.eval()
    device = _device_of(model)
    first = batches[0][0][:8].to(device)
    maps = [m.cpu() for m in attention_maps(model, first)]
    grid = model.grid_size
    query = query_patch if query_patch is not None else (grid // 2) * grid + grid // 2
    per_head, n_images = head_distances(model, batches, device)
    patch = model.patch_embed.patch_size[0]
    result = {
        "images": n_images,
        "device": str(device),
        "gating": gating(model),
        "nonlocality": [sum(h) / len(h) for h in per_head],
        "attention_distance_px": [[d * patch for d in h] for h in per_head],
        "masking_top1": masking_table(model, batches),
        "cka_self": cka_matrix(model, model, batches).tolist(),
        "query_patch": query,
    }
    files = [plots.gating_heatmap(result["gating"], out / "gating.png"),
             plots.nonlocality_per_layer(result["nonlocality"], model.local_up_to_layer, out / "nonlocality.png"),
             plots.attention_maps(maps, first[0].cpu(), query, grid, result["gating"], out / "attention_maps.png"),
             plots.attention_distance(result["attention_distance_px"], out / "attention_distance.png"),
             plots.cka_heatmap(result["cka_self"], names[0], names[0], out / "cka_self.png")]
    if compare is not None:
        result["cka_compare"] = cka_matrix(model, compare, batches).tolist()
        result["compare_nonlocality"] = [sum(h) / len(h) for h in head_distances(compare, batches, device)[0]]
        files.append(plots.cka_heatmap(result["cka_compare"], names[0], names[1], out / "cka_compare.png"))
    if run_dir is not None:
        hist = history(run_dir)
        result["history"] = hist
        if hist["epoch"]:
            files += [plots.gating_history(hist, out / "gating_history.png"),
                      plots.nonlocality_history(hist, out / "nonlocality_history.png")]
    result["files"] = [str(f) for f in files]
    (out / "analysis.json").write_text(json.dumps(result, indent=1))
    return result
