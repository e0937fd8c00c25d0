"""The paper's test-time masking (Tables 5 and 6): the position embedding, or the content or positional attention
of any set of GPSA layers (the first k, the last, a list), measured with the one evaluation loop
(``evaluation.evaluate``) on as many validation images as asked.

A GPSA layer with its content attention masked attends by position only (sigmoid(lambda) = 1 in every head); with
its positional attention masked, by content only (sigmoid(lambda) = 0).
"""

from __future__ import annotations

import contextlib
import re
from typing import Iterable

import torch

from ..errors import BadInput
from ..evaluation import Batches, evaluate
from ..models.convit import GPSA, ConViT

SPEC = re.compile(r"^(?:first(\d+)|last(\d*)|all|(\d+(?:,\d+)*))$")
SPECS_HELP = ("firstK (the first K GPSA layers), last or lastK, all, or a comma list of GPSA layer indices "
              "(0 = the first GPSA layer), e.g. first1 last 0,4")


def gpsa_layers(spec: str, n_gpsa: int) -> tuple[int, ...]:
    """The GPSA layer indices (0 .. n_gpsa - 1) a masking spec names (``SPECS_HELP``); ValueError naming the spec
    and what is allowed otherwise."""
    m = SPEC.match(spec)
    if m is None:
        raise BadInput(f"--masking {spec!r}: allowed: {SPECS_HELP}")
    first, last, listed = m.groups()
    if first is not None:
        layers = tuple(range(int(first)))
    elif spec.startswith("last"):
        layers = tuple(range(n_gpsa - int(last or 1), n_gpsa))
    elif spec == "all":
        layers = tuple(range(n_gpsa))
    else:
        layers = tuple(sorted({int(i) for i in listed.split(",")}))
    if not layers or min(layers) < 0 or max(layers) >= n_gpsa:
        raise BadInput(f"--masking {spec!r}: names GPSA layers {list(layers)}, the model has {n_gpsa} "
                       f"(0..{n_gpsa - 1}); allowed: {SPECS_HELP}")
    return layers


def default_specs(n_gpsa: int) -> list[str]:
    """Table 6's maskings: the first GPSA layer, the last one, the first half and all of them."""
    return list(dict.fromkeys(s for s in ("first1", "last", f"first{max(1, n_gpsa // 2)}", f"first{n_gpsa}")))


def spec_key(spec: str) -> str:
    """A spec as a key of the table: first_2, last, last_2, all, layers_0_4."""
    if spec.startswith("first"):
        return f"first_{spec[5:]}"
    if spec.startswith("last") and spec != "last":
        return f"last_{spec[4:]}"
    if spec[0].isdigit():
        return "layers_" + "_".join(spec.split(","))
    return spec


@contextlib.contextmanager
def masked(model: ConViT, pos_embed: bool = False, content_layers: int = 0, position_layers: int = 0,
           content: Iterable[int] = (), position: Iterable[int] = ()):
    """The model with its position embedding zeroed (Table 5) and/or the content or positional attention of GPSA
    layers masked (Table 6): ``content_layers``/``position_layers`` the first k, ``content``/``position`` any
    layers by GPSA index. A layer can lose one of the two, not both."""
    content = set(content) | set(range(content_layers))
    position = set(position) | set(range(position_layers))
    if content & position:
        raise ValueError(f"GPSA layers {sorted(content & position)} cannot lose both content and position")
    saved = model.pos_embed.detach().clone()
    gpsa = [b.attn for b in model.blocks if isinstance(b.attn, GPSA)]
    try:
        if pos_embed:
            with torch.no_grad():
                model.pos_embed.zero_()
        for i, attn in enumerate(gpsa):
            attn.mask = "content" if i in content else ("position" if i in position else None)
        yield model
    finally:
        with torch.no_grad():
            model.pos_embed.copy_(saved)
        for attn in gpsa:
            attn.mask = None


@torch.no_grad()
def accuracy(model: ConViT, data) -> float:
    """Top-1 in percent over ``data`` (batches in memory, or a loader: anything with ``epoch`` and ``num_real``),
    with training's evaluation loop, on the model's device."""
    model.eval()
    source = data if hasattr(data, "epoch") else Batches(data)
    return evaluate(model, source, next(model.parameters()).device)["top1"]


def masking_table(model: ConViT, data, specs: list[str] | None = None) -> dict:
    """Top-1 unmasked, without the position embedding, and with the content or the positional attention of each
    spec's GPSA layers masked (default: ``default_specs``)."""
    n_gpsa = len(model.gpsa_blocks())
    table = {"none": accuracy(model, data)}
    with masked(model, pos_embed=True):
        table["position_embedding"] = accuracy(model, data)
    if n_gpsa == 0:
        return table
    for spec in specs or default_specs(n_gpsa):
        layers, key = gpsa_layers(spec, n_gpsa), spec_key(spec)
        with masked(model, content=layers):
            table[f"content_attention_{key}"] = accuracy(model, data)
        with masked(model, position=layers):
            table[f"position_attention_{key}"] = accuracy(model, data)
    return table
