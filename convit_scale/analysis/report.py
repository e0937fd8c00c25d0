"""`convit-scale analyze`: every measurement of the paper's Section 4 (and of Raghu et al. 2021) for a checkpoint,
as PNGs and one JSON.

Inputs: a run checkpoint directory, an exported .safetensors or published weights; optionally a second
model to compare (CKA between models: another ConViT/DeiT, or a timm CNN such as a ResNet, as in "Do Vision
Transformers See Like Convolutional Neural Networks?"); optionally the run folder for the histories over training.
"""

from __future__ import annotations

import contextlib
import json
from pathlib import Path

import torch
import yaml
from timm.models import get_pretrained_cfg_value, is_model
from torch import nn

from ..config import DataConfig
from ..data import LoaderSpec, build_loader
from ..errors import BadInput
from ..metrics import read_records
from ..models import MODELS
from ..models.convit import ConViT
from ..models.weights import load_timm_model, read_state_dict
from ..trained import load_trained_model
from . import (
    ANALYSIS_IMAGES,  # noqa: F401  (re-exported: the default number of images)
    plots,
)
from .attention import attention_maps, gating, head_distances
from .cka import MinibatchCKA
from .masking import masked, masking_table  # noqa: F401 - masked: imported from here by callers


def eval_loader(data: str, fmt: str, img_size: int, batch_size: int = 32, **view):
    """The validation loader of the eval transform. ``view``: the run's ``eval_crop_ratio`` and ``interpolation``
    (``trained.eval_view``), so that the analysis sees the images as the run's evaluation did; DeiT's (0.875,
    bicubic) otherwise."""

    d = DataConfig(format=fmt, train_path=data, val_path=data, num_workers=0, **view)
    return build_loader(d, LoaderSpec("val", img_size, batch_size))


class FirstImages:
    """The first ``images`` validation images of ``loader`` (all of them if it has fewer), streamed a batch at a
    time: what ``evaluate`` reads (``epoch``, ``num_real``), for a masking measured on the whole validation set
    without holding it in memory."""

    def __init__(self, loader, images: int | None = None):
        self.loader = loader
        self.num_real = loader.num_real if images is None else min(images, loader.num_real)

    def epoch(self, epoch: int = 0):
        seen = 0
        with contextlib.closing(iter(self.loader.epoch(epoch))) as batches:  # an FFCV epoch stops its thread
            for x, y in batches:
                n = min(len(y), self.num_real - seen)  # the padding of the last batch is not an image
                if n <= 0:
                    return
                yield x[:n], y[:n]
                seen += n


def eval_batches(data: str, fmt: str, img_size: int, images: int, batch_size: int = 32, **view) -> list:
    """The first ``images`` validation images (eval transform, fewer if the split is smaller) as batches of
    ``batch_size``, kept in host memory for every analysis (1,024 images at 224 are 0.6 GB)."""
    return list(FirstImages(eval_loader(data, fmt, img_size, batch_size, **view), images).epoch(0))


def _device_of(model: torch.nn.Module) -> torch.device:
    return next(model.parameters()).device


@torch.no_grad()
def layer_representations(model: ConViT, x: torch.Tensor) -> list[torch.Tensor]:
    model.eval()
    return model.forward_features(x.to(_device_of(model), non_blocking=True), return_layers=True)[1]


def cnn_layers(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """The layers whose outputs a CNN's CKA reads: every residual block of a ResNet (``layer1`` .. ``layer4``, as
    Raghu et al. compare ViTs with ResNets), else the stage outputs timm lists in ``feature_info``."""
    if all(hasattr(model, f"layer{i}") for i in range(1, 5)):
        return [(f"layer{i}.{j}", block) for i in range(1, 5) for j, block in enumerate(getattr(model, f"layer{i}"))]
    info = getattr(model, "feature_info", None)
    if info:
        return [(f["module"], model.get_submodule(f["module"])) for f in info]
    raise BadInput(f"{type(model).__name__}: no residual blocks (layer1-4) or feature_info to compare layer by "
                   f"layer; allowed: a ConViT/DeiT, or a timm ResNet or CNN with feature_info")


@torch.no_grad()
def layer_grams(model: nn.Module, x: torch.Tensor) -> list[torch.Tensor]:
    """The (n, n) linear Gram matrix of every layer's representation of the batch ``x`` (flattened per example):
    a ConViT's blocks (patch tokens), a CNN's ``cnn_layers``, each computed as the layer runs so that a ResNet's
    activations are never all held at once."""
    model.eval()
    x = x.to(_device_of(model), non_blocking=True)
    if isinstance(model, ConViT):
        return [MinibatchCKA.gram(r) for r in layer_representations(model, x)]
    grams, hooks = [], []
    for _, layer in cnn_layers(model):
        hooks.append(layer.register_forward_hook(lambda m, i, out: grams.append(MinibatchCKA.gram(out))))
    try:
        model(x)
    finally:
        for h in hooks:
            h.remove()
    return grams


def n_layers(model: nn.Module) -> int:
    return len(model.blocks) if isinstance(model, ConViT) else len(cnn_layers(model))


@torch.no_grad()
def cka_matrix(a: nn.Module, b: nn.Module, batches) -> torch.Tensor:
    """Minibatch linear CKA between every layer of ``a`` (rows) and of ``b`` (columns): ConViTs, DeiTs or CNNs."""
    acc = MinibatchCKA(n_layers(a), n_layers(b))
    for x, _ in batches:
        acc.update_grams(layer_grams(a, x), layer_grams(b, x))
    return acc.compute()


def load_compare(path: str | Path, name: str | None = None) -> nn.Module:
    """The model ``--compare`` names: a ConViT/DeiT (a run checkpoint, an export, published weights; ``name`` one
    of ours), or a timm CNN of that ``name`` from a local weights file (its classes read from the file's
    classifier), e.g. ``resnet50``. Nothing is downloaded."""

    if name is None or name in MODELS:
        return load_trained_model(path, name)

    if not is_model(name):
        raise BadInput(f"--compare-model {name!r} is neither one of this project's models nor a timm model")
    classifier = get_pretrained_cfg_value(name, "classifier") or "fc"
    head = read_state_dict(path).get(f"{classifier}.weight")
    return load_timm_model(name, path, num_classes=None if head is None else head.shape[0],
                           what=f"--compare {path}", name_key="--compare-model").eval()


def write_masking_table(table: dict, path: Path) -> Path:
    """The masking's top-1 (Tables 5 and 6) as a CSV file: one row per condition (``none``: unmasked)."""
    rows = ["condition,top1"] + [f"{name},{top1:.4f}" for name, top1 in table.items()]
    path.write_text("\n".join(rows) + "\n")
    return path


def history(run_dir: Path) -> dict:
    """Gating and nonlocality over training, from a run's metrics.jsonl."""
    recs = read_records(run_dir, "analysis")
    return {"epoch": [r["epoch"] for r in recs], "gating": [r["gating"] for r in recs],
            "nonlocality": [r["nonlocality"] for r in recs]}


def curves(run_dir: Path) -> dict:
    """Loss and learning rate per logged step, top-1/top-5 per evaluated epoch, and the paper's top-1 of the run's
    recipe (its config.yaml), from a run folder."""
    train = [r for r in read_records(run_dir, "train") if r.get("loss") is not None]
    evals = read_records(run_dir, "eval")
    paper = None
    if (run_dir / "config.yaml").is_file():
        paper = (yaml.safe_load((run_dir / "config.yaml").read_text()) or {}).get("paper", {}).get("top1")
    return {"step": [r["step"] for r in train], "loss": [r["loss"] for r in train], "lr": [r["lr"] for r in train],
            "eval_epoch": [r["epoch"] for r in evals], "top1": [r["top1"] for r in evals],
            "top5": [r["top5"] for r in evals], "paper_top1": paper}


def analyze(model: ConViT, batches, out: Path, compare: nn.Module | None = None, run_dir: Path | None = None,
            names: tuple[str, str] = ("model", "compare"), query_patch: int | None = None, masking_data=None,
            masking_specs: list[str] | None = None) -> dict:
    """Compute everything on the models' device over every image of ``batches`` (host tensors, moved one batch
    at a time), write the plots and ``analysis.json`` into ``out``; returns the numbers. The masking reads
    ``masking_data`` when given (``FirstImages`` of a loader: as many validation images as asked, streamed), with
    ``masking_specs`` (``masking.gpsa_layers``; default: the first GPSA layer, the last, the first half, all)."""

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
        "masking_top1": masking_table(model, batches if masking_data is None else masking_data, masking_specs),
        "masking_images": n_images if masking_data is None else masking_data.num_real,
        "cka_self": cka_matrix(model, model, batches).tolist(),
        "query_patch": query,
        "names": list(names),
    }
    files = [plots.gating_heatmap(result["gating"], out / "gating.png")] if result["gating"] else []  # a DeiT: none
    files += [plots.attention_maps(maps, first[0].cpu(), query, grid, result["gating"], out / "attention_maps.png"),
              plots.attention_distance(result["attention_distance_px"], out / "attention_distance.png"),
              plots.cka_heatmap(result["cka_self"], names[0], names[0], out / "cka_self.png")]
    if compare is not None:
        result["cka_compare"] = cka_matrix(model, compare, batches).tolist()
        if isinstance(compare, ConViT):
            result["compare_nonlocality"] = [sum(h) / len(h) for h in head_distances(compare, batches, device)[0]]
        else:
            result["compare_layers"] = [name for name, _ in cnn_layers(compare)]
        files.append(plots.cka_heatmap(result["cka_compare"], names[0], names[1], out / "cka_compare.png"))
    files += [plots.nonlocality_per_layer(result["nonlocality"], model.local_up_to_layer, out / "nonlocality.png",
                                          result.get("compare_nonlocality"), names),
              write_masking_table(result["masking_top1"], out / "masking_top1.csv")]
    if run_dir is not None:
        hist = history(run_dir)
        result["history"] = hist
        if hist["epoch"] and hist["gating"][0]:  # a DeiT has no gating to follow
            files.append(plots.gating_history(hist, out / "gating_history.png"))
        if hist["epoch"]:
            files.append(plots.nonlocality_history(hist, out / "nonlocality_history.png"))
        result["curves"] = curves(run_dir)
        if result["curves"]["step"]:
            files.append(plots.training_curves(result["curves"], out / "training_curves.png"))
    result["files"] = [str(f) for f in files]
    (out / "analysis.json").write_text(json.dumps(result, indent=1))
    return result
