"""Matplotlib figures after the paper's Figs. 5-7 and Raghu et al.'s attention-distance and CKA plots."""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # files only; no display on cluster nodes
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
import torch  # noqa: E402


def _save(fig, path: Path) -> Path:
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def gating_heatmap(gates: list[list[float]], path: Path) -> Path:
    """sigma(lambda) per GPSA layer (rows) and head (columns): 1 = positional, 0 = content (Fig. 6)."""
    fig, ax = plt.subplots(figsize=(1 + 0.6 * max(len(g) for g in gates), 1 + 0.45 * len(gates)))
    im = ax.imshow(np.array(gates), vmin=0, vmax=1, cmap="viridis", aspect="auto")
    ax.set_xlabel("head")
    ax.set_ylabel("GPSA layer")
    ax.set_title("gating sigma(lambda)")
    fig.colorbar(im, ax=ax)
    return _save(fig, path)


def nonlocality_per_layer(values: list[float], n_gpsa: int, path: Path, compare: list[float] | None = None,
                          names: tuple[str, str] = ("model", "compare")) -> Path:
    """Nonlocality of each layer (Eq. 8); with ``compare``, the second model's beside it, as Fig. 5 sets the ConViT
    against the DeiT (the first model's GPSA layers in orange)."""
    fig, ax = plt.subplots(figsize=(6, 3.5))
    colors = ["tab:orange" if i < n_gpsa else "tab:blue" for i in range(len(values))]
    width = 0.4 if compare is not None else 0.8
    offset = -width / 2 if compare is not None else 0.0
    ax.bar(np.arange(len(values)) + offset, values, width=width, color=colors, label=names[0])
    if compare is not None:
        ax.bar(np.arange(len(compare)) + width / 2, compare, width=width, color="tab:grey", label=names[1])
        ax.legend(fontsize=7)
    ax.set_xlabel("layer (orange: GPSA, blue: self-attention)")
    ax.set_ylabel("nonlocality (patches)")
    ax.set_title("nonlocality per layer (Eq. 8)")
    return _save(fig, path)


def attention_maps(maps: list[torch.Tensor], image: torch.Tensor, query: int, grid: int,
                   gates: list[list[float]], path: Path) -> Path:
    """Attention of one query patch, per layer (rows) and head (columns), gating in the titles (Fig. 7)."""
    heads = max(m.shape[1] for m in maps)
    fig, axes = plt.subplots(len(maps), heads + 1, figsize=(1.6 * (heads + 1), 1.6 * len(maps)), squeeze=False)
    img = image.permute(1, 2, 0).float().numpy()
    img = (img - img.min()) / max(img.max() - img.min(), 1e-9)
    qy, qx = divmod(query, grid)
    for layer, m in enumerate(maps):
        ax = axes[layer, 0]
        ax.imshow(img)
        ax.scatter([(qx + 0.5) * img.shape[1] / grid], [(qy + 0.5) * img.shape[0] / grid], c="red", s=12)
        ax.set_ylabel(f"layer {layer}", fontsize=7)
        for h in range(heads):
            ax = axes[layer, h + 1]
            if h < m.shape[1]:
                ax.imshow(m[0, h, query].reshape(grid, grid).float().numpy(), cmap="magma")
                if layer < len(gates):
                    ax.set_title(f"h{h} g={gates[layer][h]:.2f}", fontsize=6)
    for ax in axes.flat:
        ax.set_xticks([])
        ax.set_yticks([])
    return _save(fig, path)


def attention_distance(dist_px: list[list[float]], path: Path) -> Path:
    """Mean attention distance per head, sorted within each layer (Raghu et al.)."""
    fig, ax = plt.subplots(figsize=(6, 3.5))
    for layer, heads in enumerate(dist_px):
        ax.scatter([layer] * len(heads), sorted(heads), s=12)
    ax.set_xlabel("layer")
    ax.set_ylabel("mean attention distance (pixels)")
    return _save(fig, path)


def cka_heatmap(matrix, row_name: str, col_name: str, path: Path) -> Path:
    fig, ax = plt.subplots(figsize=(4.5, 4))
    im = ax.imshow(np.array(matrix), origin="lower", vmin=0, vmax=1, cmap="magma")
    ax.set_xlabel(f"{col_name} layer")
    ax.set_ylabel(f"{row_name} layer")
    ax.set_title("linear CKA (minibatch, unbiased HSIC)")
    fig.colorbar(im, ax=ax)
    return _save(fig, path)


def gating_history(hist: dict, path: Path) -> Path:
    """sigma(lambda) of every head over training, one panel per GPSA layer (Fig. 6); dashed: the initial value."""
    g = np.array(hist["gating"])  # (records, layers, heads)
    layers = g.shape[1]
    fig, axes = plt.subplots(1, layers, figsize=(2.2 * layers, 2.4), squeeze=False, sharey=True)
    for layer in range(layers):
        axes[0, layer].plot(hist["epoch"], g[:, layer, :], marker="o", ms=3)  # one evaluation is one point
        axes[0, layer].axhline(1 / (1 + np.exp(-1.0)), ls="--", lw=0.8, c="grey")  # lambda's init, 1: 0.731
        axes[0, layer].set_title(f"layer {layer}", fontsize=8)
        axes[0, layer].set_xlabel("epoch")
    axes[0, 0].set_ylabel("sigma(lambda)")
    return _save(fig, path)


def nonlocality_history(hist: dict, path: Path) -> Path:
    """Nonlocality of each layer over training (Fig. 5)."""
    n = np.array(hist["nonlocality"])  # (records, layers)
    fig, ax = plt.subplots(figsize=(6, 3.5))
    for layer in range(n.shape[1]):
        ax.plot(hist["epoch"], n[:, layer], marker="o", ms=3, label=f"layer {layer}")
    ax.set_xlabel("epoch")
    ax.set_ylabel("nonlocality (patches)")
    ax.legend(fontsize=6, ncol=2)
    return _save(fig, path)


def training_curves(curves: dict, path: Path) -> Path:
    """Training loss and learning rate against the step, top-1 against the epoch, beside the paper's top-1 where the
    recipe names it (dashed)."""
    fig, axes = plt.subplots(1, 3, figsize=(12, 3.2))
    axes[0].plot(curves["step"], curves["loss"], lw=0.8, marker="o" if len(curves["step"]) == 1 else None)
    axes[0].set_xlabel("step")
    axes[0].set_ylabel("training loss")
    axes[1].plot(curves["step"], curves["lr"], lw=0.8)
    axes[1].set_xlabel("step")
    axes[1].set_ylabel("learning rate")
    axes[2].plot(curves["eval_epoch"], curves["top1"], marker="o", ms=3, label="top-1")
    axes[2].plot(curves["eval_epoch"], curves["top5"], marker="o", ms=3, label="top-5")
    if curves.get("paper_top1") is not None:
        axes[2].axhline(curves["paper_top1"], ls="--", c="grey", label=f"paper {curves['paper_top1']:g}")
    axes[2].set_xlabel("epoch")
    axes[2].set_ylabel("validation accuracy (%)")
    axes[2].legend(fontsize=7)
    return _save(fig, path)


def sample_efficiency(table: dict, path: Path) -> Path:
    """Top-1 against the fraction of training data, one line per model (Table 2 as a figure)."""
    fig, ax = plt.subplots(figsize=(5, 3.5))
    for model, points in table.items():
        fs = sorted(points, key=float)
        ax.plot([float(f) for f in fs], [points[f] for f in fs], marker="o", label=model)
    ax.set_xscale("log")
    ax.set_xlabel("fraction of training images (epochs x 1/f)")
    ax.set_ylabel("top-1 (%)")
    ax.legend()
    return _save(fig, path)
