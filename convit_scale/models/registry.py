"""The named models: the 12 rows of the paper's Table 1 and small variants for CPU runs."""

from __future__ import annotations

import fnmatch
import functools
from dataclasses import dataclass

import torch
from torch.utils.flop_counter import FlopCounterMode

from ..errors import BadInput
from .convit import ConViT
from .weights import load_pretrained


@dataclass(frozen=True)
class ModelSpec:
    num_heads: int
    head_dim: int
    local_up_to_layer: int
    """Number of GPSA blocks (0 = DeiT)."""
    paper_params_m: float | None = None
    """Parameters in millions, as printed in Table 1."""
    paper_gmacs: float | None = None
    paper_top1: float | None = None
    img_size: int = 224
    patch_size: int = 16
    depth: int = 12
    qkv_bias: bool | None = None
    """None: True for DeiT (as timm's deit_*), False for ConViT (as the official code)."""

    @property
    def embed_dim(self) -> int:
        return self.num_heads * self.head_dim

    def kwargs(self) -> dict:
        qkv_bias = self.qkv_bias if self.qkv_bias is not None else self.local_up_to_layer == 0
        return dict(
            img_size=self.img_size, patch_size=self.patch_size, embed_dim=self.embed_dim, depth=self.depth,
            num_heads=self.num_heads, local_up_to_layer=self.local_up_to_layer, qkv_bias=qkv_bias,
        )


# The paper's Section 3 and Table 1 (params in M, GMACs, top-1). The "+" DeiTs are the ones the paper
# trained with ConViT's code: a ConViT without GPSA layers, so no qkv bias (as Table 3's row e, the same model);
# the plain DeiTs are DeiT's own (timm's deit_*, qkv bias), whose published numbers the paper quotes.
MODELS: dict[str, ModelSpec] = {
    "deit_tiny": ModelSpec(3, 64, 0, 6, 1, 72.2),
    "convit_tiny": ModelSpec(4, 48, 10, 6, 1, 73.1),
    "deit_tiny_plus": ModelSpec(4, 64, 0, 10, 2, 75.9, qkv_bias=False),
    "convit_tiny_plus": ModelSpec(4, 64, 10, 10, 2, 76.7),
    "deit_small": ModelSpec(6, 64, 0, 22, 4.3, 79.8),
    "convit_small": ModelSpec(9, 48, 10, 27, 5.4, 81.3),
    "deit_small_plus": ModelSpec(9, 64, 0, 48, 10, 79.0, qkv_bias=False),
    "convit_small_plus": ModelSpec(9, 64, 10, 48, 10, 82.2),
    "deit_base": ModelSpec(12, 64, 0, 86, 17, 81.8),
    "convit_base": ModelSpec(16, 48, 10, 86, 17, 82.4),
    "deit_base_plus": ModelSpec(16, 64, 0, 152, 30, 77.5, qkv_bias=False),
    "convit_base_plus": ModelSpec(16, 64, 10, 152, 30, 82.5),
    # CPU-sized variants (32x32 input, patch 4: an 8x8 grid), used by the tests and `make demo`.
    "convit_micro": ModelSpec(4, 16, 4, img_size=32, patch_size=4, depth=6),
    "deit_micro": ModelSpec(4, 16, 0, img_size=32, patch_size=4, depth=6),
    "convit_nano": ModelSpec(4, 8, 2, img_size=16, patch_size=4, depth=3),
    "deit_nano": ModelSpec(4, 8, 0, img_size=16, patch_size=4, depth=3),
}

PAPER_MODELS = [name for name, spec in MODELS.items() if spec.paper_params_m is not None]


def list_models(pattern: str = "*") -> list[str]:
    """Names of the registered models matching a shell-style pattern (as ``timm.list_models``)."""

    return [name for name in MODELS if fnmatch.fnmatch(name, pattern)]


def create_model(name: str, pretrained_file: str | None = None, device: str | torch.device | None = None,
                 **options) -> ConViT:
    """Build a named model; ``options`` override the registry (``num_classes``, ``img_size``,
    ``drop_path_rate``, ``local_up_to_layer``, ``locality_strength``, ``distill_token``, ``gpsa_impl``,
    ``conv_init``, ``train_gating``, ``freeze_gpsa``, ...). ``device="meta"`` builds without memory;
    call ``to_empty`` then ``init_weights()``. ``pretrained_file`` loads published weights (local file)."""
    if name not in MODELS:
        raise BadInput(f"unknown model {name!r}; known: {', '.join(MODELS)}")
    kwargs = MODELS[name].kwargs()
    kwargs.update(options)
    # Always build on the meta device and initialise once with init_weights(): construction costs no
    # memory or RNG, and an eager build equals a meta build followed by to_empty + init_weights.
    # The target is the default device when none is given, so `with torch.device("meta"): create_model(...)`
    # (FSDP2's usual idiom) builds on meta exactly like `device="meta"`.
    target = torch.device(device) if device is not None else torch.get_default_device()
    with torch.device("meta"):
        model = ConViT(**kwargs)
    if target.type != "meta":
        model.to_empty(device=target)
        model.init_weights()
    if pretrained_file is not None:
        load_pretrained(model, pretrained_file)
    return model


@functools.lru_cache(maxsize=None)
def forward_flops(name: str, **options) -> int:
    """FLOPs (two per multiply-add) of one image's forward pass, counted by torch's FlopCounterMode on
    the meta device (no memory; about a second of CPU for a base model, so counted once per process).
    A training step costs three times this (MFU's convention)."""

    model = create_model(name, device="meta", **options).eval()
    size = options.get("img_size") or MODELS[name].img_size
    with FlopCounterMode(display=False) as counter:
        model(torch.empty(1, 3, size, size, device="meta"))
    return counter.get_total_flops()
