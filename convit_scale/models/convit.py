"""ConViT (d'Ascoli et al., ICML 2021) and its DeiT baselines as one network.

A DeiT is a ConViT with zero GPSA layers. The module knows nothing of FSDP, DeepSpeed or DDP: it can be
built on the meta device, sharded, materialised with ``to_empty`` and then initialised by
``init_weights()`` (the convolutional init of the paper's Section 3 included).

Shapes: B batch, L patch tokens, T = L + number of class/distillation tokens, D = embed_dim,
H heads, hd = head_dim.
"""

from __future__ import annotations

from contextlib import nullcontext
from typing import Literal

import torch
import torch.nn.functional as F
from timm.layers import Mlp, PatchEmbed, trunc_normal_
from timm.layers import drop_path as timm_drop_path
from torch import nn
from torch.distributed.tensor import distribute_tensor
from torch.utils.checkpoint import checkpoint

from ..errors import BadInput
from ..splitmix import draw, keys_of, srl

GpsaImpl = Literal["fast", "reference"]


def relative_positions(grid_size: int, device: torch.device | str | None = None) -> torch.Tensor:
    """r_ij = (dx, dy, dx^2 + dy^2) between patches i and j of a grid_size x grid_size grid.

    Patch index i = row * grid_size + col. Returns (L, L, 3) float32, exact (values up to 2*(g-1)^2).
    Same ordering as the reference code's ``get_rel_indices``: dx is the column offset, dy the row offset.
    """
    idx = torch.arange(grid_size, device=device)
    ind = idx.view(1, -1) - idx.view(-1, 1)  # (g, g): ind[a, b] = b - a
    indx = ind.repeat(grid_size, grid_size)
    indy = ind.repeat_interleave(grid_size, dim=0).repeat_interleave(grid_size, dim=1)
    indd = indx**2 + indy**2
    return torch.stack([indx, indy, indd], dim=-1).to(torch.float32)


def _fill_(param: torch.Tensor, value: torch.Tensor) -> None:
    """Copy a full (unsharded) value into a parameter that may be a sharded DTensor."""
    with torch.no_grad():
        if hasattr(param, "device_mesh"):  # DTensor from FSDP2's fully_shard

            value = distribute_tensor(value.to(param.dtype), param.device_mesh, param.placements)
        param.copy_(value)


class GPSA(nn.Module):
    """Gated positional self-attention (the paper's Section 3).

    A_ij = (1 - sigmoid(lambda_h)) softmax_j(q_i.k_j / sqrt(hd)) + sigmoid(lambda_h) softmax_j(v_pos_h . r_ij)

    ``impl="fast"`` uses fused scaled-dot-product attention for the content term and one (H, L, L)
    positional matrix shared by the whole batch, applied to the values as a single (H, L, L) x
    (H, L, B*hd) matmul, so no (B, H, L, L) tensor exists in forward or backward.
    ``impl="reference"`` follows the equation literally (and the reference code's final row
    normalisation, which is a no-op since both softmaxes are row-stochastic).
    """

    def __init__(
        self,
        dim: int,
        num_heads: int,
        grid_size: int,
        qkv_bias: bool = False,
        locality_strength: float = 1.0,
        impl: GpsaImpl = "fast",
    ) -> None:
        super().__init__()
        self.num_heads = num_heads
        self.head_dim = dim // num_heads
        self.scale = self.head_dim**-0.5
        self.locality_strength = locality_strength
        self.impl: GpsaImpl = impl
        self.mask: Literal["content", "position"] | None = None
        """Test-time masking (paper Tables 5-6): attend by position only ("content") or content only."""
        self.grid_size = grid_size
        self.qk = nn.Linear(dim, dim * 2, bias=qkv_bias)
        self.v = nn.Linear(dim, dim, bias=qkv_bias)
        self.proj = nn.Linear(dim, dim)
        self.pos_proj = nn.Linear(3, num_heads)
        self.gating_param = nn.Parameter(torch.ones(num_heads))
        # Non-persistent: derived from the grid, never loaded, rebuilt for another resolution.
        self.register_buffer("rel_indices", relative_positions(grid_size), persistent=False)  # (L, L, 3)

    def _apply(self, fn, recurse=True):
        # Keep the relative positions in fp32 whatever the parameter dtype: in bf16, d^2 > 256 rounds.
        super()._apply(fn, recurse)
        buf = self.rel_indices
        if buf.dtype != torch.float32 and buf.device.type != "meta":
            self.rel_indices = relative_positions(self.grid_size, device=buf.device)
        return self

    def reset_buffers(self, grid_size: int | None = None) -> None:
        if grid_size is not None:
            self.grid_size = grid_size
        self.rel_indices = relative_positions(self.grid_size, device=self.rel_indices.device)

    def init_weights(self, conv_init: bool = True, train_gating: bool = True) -> None:
        """timm/ConViT init, then the convolutional ("local") init of the paper's Section 3 when asked."""
        for lin in (self.qk, self.v, self.proj, self.pos_proj):
            trunc_normal_(lin.weight, std=0.02)
            if lin.bias is not None:
                nn.init.zeros_(lin.bias)
        # lambda_h = 1 when the gating trains; frozen at lambda = 0 otherwise (Table 3, row b).
        nn.init.constant_(self.gating_param, 1.0 if train_gating else 0.0)
        if conv_init:
            self.local_init()

    def local_init(self) -> None:
        """W_val = identity; head (h1, h2) at h1 + k*h2 gets v_pos = alpha (2(h2-c), 2(h1-c), -1)."""
        dim = self.v.weight.shape[1]
        _fill_(self.v.weight, torch.eye(dim))
        kernel_size = int(self.num_heads**0.5)
        center = (kernel_size - 1) / 2 if kernel_size % 2 == 0 else kernel_size // 2
        weight = torch.zeros(self.num_heads, 3)
        # Heads beyond k*k (a non-square head count) keep zero weights: a uniform positional prior.
        for h1 in range(kernel_size):
            for h2 in range(kernel_size):
                position = h1 + kernel_size * h2
                weight[position] = torch.tensor([2.0 * (h2 - center), 2.0 * (h1 - center), -1.0])
        _fill_(self.pos_proj.weight, weight * self.locality_strength)

    # -- attention pieces ----------------------------------------------------------------------
    def positional_attention(self) -> torch.Tensor:
        """softmax_j(v_pos_h . r_ij + b_h), (H, L, L) in fp32, independent of the image."""
        device_type = self.rel_indices.device.type
        no_autocast = torch.autocast(device_type, enabled=False) if device_type in ("cpu", "cuda") else nullcontext()
        with no_autocast:
            scores = F.linear(self.rel_indices, self.pos_proj.weight.float(), self.pos_proj.bias.float())
            position = scores.permute(2, 0, 1).softmax(dim=-1)  # (H, L, L)
        # A local head puts exp(-d^2)-sized weights on far patches: subnormal floats, which make CPU
        # matmuls ~10x slower. Flushing them to zero changes each row's sum by less than 1e-36.
        return position.masked_fill(position < torch.finfo(torch.float32).tiny, 0.0)

    def gating(self) -> torch.Tensor:
        return torch.sigmoid(self.gating_param.float())  # (H,)

    def _qkv(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        B, L, D = x.shape
        qk = self.qk(x).reshape(B, L, 2, self.num_heads, self.head_dim).permute(2, 0, 3, 1, 4)
        v = self.v(x).reshape(B, L, self.num_heads, self.head_dim).transpose(1, 2)
        return qk[0], qk[1], v  # each (B, H, L, hd)

    def _gate(self, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
        """sigmoid(lambda_h) as a broadcastable tensor, with test-time masking applied."""
        g = self.gating()
        if self.mask == "content":  # the head attends by position only
            g = torch.ones_like(g)
        elif self.mask == "position":  # content only
            g = torch.zeros_like(g)
        return g.to(dtype).view(shape)

    def attention_map(self, x: torch.Tensor) -> torch.Tensor:
        """The full (B, H, L, L) attention, literally as in the equation (analysis and reference)."""
        q, k, _ = self._qkv(x)
        content = ((q @ k.transpose(-2, -1)) * self.scale).softmax(dim=-1)  # (B, H, L, L)
        position = self.positional_attention().to(content.dtype).unsqueeze(0)  # (1, H, L, L)
        g = self._gate(content.dtype, (1, -1, 1, 1))
        attn = (1.0 - g) * content + g * position
        return attn / attn.sum(dim=-1, keepdim=True)  # a no-op, as in the reference code

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, L, D = x.shape
        if self.impl == "reference":
            _, _, v = self._qkv(x)
            out = self.attention_map(x) @ v  # (B, H, L, hd)
            return self.proj(out.transpose(1, 2).reshape(B, L, D))
        H, hd = self.num_heads, self.head_dim
        qk = self.qk(x).reshape(B, L, 2, H, hd).permute(2, 0, 3, 1, 4)
        # The values, laid out once as (H, L, B, hd): the positional matmul reads them as (H, L, B*hd)
        # and SDPA as a (B, H, L, hd) view, so autograd keeps a single copy of them.
        v_heads = self.v(x).reshape(B, L, H, hd).permute(2, 1, 0, 3).contiguous()  # (H, L, B, hd)
        content = F.scaled_dot_product_attention(qk[0], qk[1], v_heads.permute(2, 0, 1, 3))  # (B, H, L, hd)
        position = self.positional_attention().to(v_heads.dtype)  # (H, L, L)
        g = self._gate(torch.float32, (H,))
        out = _GatedPositionalMix.apply(content, position, v_heads, g)  # (B, L, H, hd)
        return self.proj(out.reshape(B, L, D))


class _GatedPositionalMix(torch.autograd.Function):
    """out = (1 - g_h) content + g_h (P_h @ V_h), with P shared by the batch, as one autograd node.

    The positional product runs as one (H, L, L) @ (H, L, B*hd) matmul per direction, so no
    (B, H, L, L) tensor exists. Only what backward needs is kept: content (SDPA keeps it anyway), P and
    the values; P @ V is recomputed in backward for the gating gradient instead of being stored.
    Shapes: content (B, H, L, hd), position (H, L, L), v_heads (H, L, B, hd), g (H,) -> (B, L, H, hd).
    """

    @staticmethod
    def forward(ctx, content, position, v_heads, g):
        H, L, B, hd = v_heads.shape
        pos_out = torch.bmm(position, v_heads.view(H, L, B * hd)).view(H, L, B, hd).permute(2, 1, 0, 3)
        gate = g.to(content.dtype).view(1, 1, H, 1)
        ctx.save_for_backward(content, position, v_heads, g)
        return content.transpose(1, 2) * (1.0 - gate) + pos_out * gate  # (B, L, H, hd)

    @staticmethod
    def backward(ctx, grad_out):
        content, position, v_heads, g = ctx.saved_tensors
        H, L, B, hd = v_heads.shape
        gate = g.to(grad_out.dtype).view(1, 1, H, 1)
        grad_content = (grad_out * (1.0 - gate)).transpose(1, 2)  # (B, H, L, hd)
        grad_pos = (grad_out * gate).permute(2, 1, 0, 3).reshape(H, L, B * hd)  # (H, L, B*hd)
        v_flat = v_heads.view(H, L, B * hd)
        grad_position = torch.bmm(grad_pos, v_flat.transpose(1, 2)) if ctx.needs_input_grad[1] else None
        grad_v = torch.bmm(position.transpose(1, 2), grad_pos).view(H, L, B, hd) if ctx.needs_input_grad[2] else None
        grad_g = None
        if ctx.needs_input_grad[3]:  # d out / d g_h = P_h V_h - content_h, summed over B, L, hd
            pos_out = torch.bmm(position, v_flat).view(H, L, B, hd).permute(2, 1, 0, 3)
            diff = pos_out - content.transpose(1, 2)
            grad_g = (grad_out * diff).sum(dim=(0, 1, 3), dtype=torch.float32).to(g.dtype)
        return grad_content, grad_position, grad_v, grad_g


class MHSA(nn.Module):
    """Plain multi-head self-attention (the last blocks of ConViT, every block of DeiT)."""

    def __init__(self, dim: int, num_heads: int, qkv_bias: bool = False) -> None:
        super().__init__()
        self.num_heads = num_heads
        self.head_dim = dim // num_heads
        self.scale = self.head_dim**-0.5
        self.qkv = nn.Linear(dim, dim * 3, bias=qkv_bias)
        self.proj = nn.Linear(dim, dim)

    def init_weights(self) -> None:
        for lin in (self.qkv, self.proj):
            trunc_normal_(lin.weight, std=0.02)
            if lin.bias is not None:
                nn.init.zeros_(lin.bias)

    def _qkv(self, x: torch.Tensor):
        B, T, D = x.shape
        qkv = self.qkv(x).reshape(B, T, 3, self.num_heads, self.head_dim).permute(2, 0, 3, 1, 4)
        return qkv[0], qkv[1], qkv[2]  # each (B, H, T, hd)

    def attention_map(self, x: torch.Tensor) -> torch.Tensor:
        q, k, _ = self._qkv(x)
        return ((q @ k.transpose(-2, -1)) * self.scale).softmax(dim=-1)  # (B, H, T, T)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, D = x.shape
        q, k, v = self._qkv(x)
        out = F.scaled_dot_product_attention(q, k, v)  # (B, H, T, hd)
        return self.proj(out.transpose(1, 2).reshape(B, T, D))


DROP_PATH_COUNTER = 1 << 40
"""Drop-path draws of a sample are splitmix64 outputs DROP_PATH_COUNTER + 2 * block + branch of the sample's seed: far
from the counters its augmentation draws from the same seed (device_augment.py)."""


class SeededDropPath(nn.Module):
    """Stochastic depth per sample (timm's DropPath: keep a sample's branch with probability 1 - p and scale it by
    1 / (1 - p)), with the keep decisions given (``keep``: (B,), 1 kept / 0 dropped, from each sample's seed; see
    ``ConViT.drop_path_keep``), so that a sample's masks are the same on any rank and world size. Without them, in
    training, it draws from the global generator as timm's does; in evaluation it is the identity."""

    def __init__(self, drop_prob: float = 0.0):
        super().__init__()
        self.drop_prob = drop_prob

    def forward(self, x: torch.Tensor, keep: torch.Tensor | None = None) -> torch.Tensor:
        if self.drop_prob == 0.0 or not self.training:
            return x
        if keep is None:
            return timm_drop_path(x, self.drop_prob, True)
        scale = keep.to(x.dtype) / (1.0 - self.drop_prob)  # timm: the 0/1 mask divided by keep_prob, in x's dtype
        return x * scale.view(-1, *([1] * (x.dim() - 1)))


class Block(nn.Module):
    """Pre-norm transformer block: x + DropPath(Attn(LN(x))), then x + DropPath(MLP(LN(x)))."""

    def __init__(
        self,
        dim: int,
        num_heads: int,
        mlp_ratio: float,
        qkv_bias: bool,
        drop_path: float,
        use_gpsa: bool,
        grid_size: int,
        locality_strength: float,
        gpsa_impl: GpsaImpl,
    ) -> None:
        super().__init__()
        self.use_gpsa = use_gpsa
        self.norm1 = nn.LayerNorm(dim, eps=1e-6)
        if use_gpsa:
            self.attn: GPSA | MHSA = GPSA(dim, num_heads, grid_size, qkv_bias, locality_strength, gpsa_impl)
        else:
            self.attn = MHSA(dim, num_heads, qkv_bias)
        self.drop_path = SeededDropPath(drop_path)
        self.norm2 = nn.LayerNorm(dim, eps=1e-6)
        self.mlp = Mlp(in_features=dim, hidden_features=int(dim * mlp_ratio), act_layer=nn.GELU)

    def forward(self, x: torch.Tensor, keep: torch.Tensor | None = None) -> torch.Tensor:
        """``keep``: (2, B) drop-path decisions of the attention and MLP branches (``ConViT.drop_path_keep``)."""
        attn_keep, mlp_keep = (None, None) if keep is None else keep.unbind(0)
        x = x + self.drop_path(self.attn(self.norm1(x)), attn_keep)
        return x + self.drop_path(self.mlp(self.norm2(x)), mlp_keep)


class ConViT(nn.Module):
    """ConViT / DeiT. ``local_up_to_layer=0`` is a DeiT; the class token joins before that block."""

    def __init__(
        self,
        img_size: int = 224,
        patch_size: int = 16,
        in_chans: int = 3,
        num_classes: int = 1000,
        embed_dim: int = 432,
        depth: int = 12,
        num_heads: int = 9,
        mlp_ratio: float = 4.0,
        qkv_bias: bool = False,
        local_up_to_layer: int = 10,
        locality_strength: float = 1.0,
        drop_path_rate: float = 0.0,
        distill_token: bool = False,
        gpsa_impl: GpsaImpl = "fast",
        conv_init: bool = True,
        train_gating: bool = True,
        freeze_gpsa: bool = False,
    ) -> None:
        super().__init__()
        if embed_dim % num_heads:
            raise BadInput(f"embed_dim {embed_dim} is not divisible by num_heads {num_heads}")
        if not 0 <= local_up_to_layer < depth:
            raise BadInput(f"local_up_to_layer must be in [0, {depth - 1}], got {local_up_to_layer}")
        if img_size % patch_size:
            raise BadInput(f"img_size {img_size} is not a multiple of patch_size {patch_size}")
        self.num_classes = num_classes
        self.embed_dim = embed_dim
        self.num_heads = num_heads
        self.local_up_to_layer = local_up_to_layer
        self.conv_init = conv_init
        self.train_gating = train_gating
        self.freeze_gpsa = freeze_gpsa
        self.grad_checkpointing = False
        self.num_prefix_tokens = 2 if distill_token else 1

        self.patch_embed = PatchEmbed(img_size=img_size, patch_size=patch_size, in_chans=in_chans, embed_dim=embed_dim)
        grid_size = img_size // patch_size
        num_patches = grid_size * grid_size
        self.pos_embed = nn.Parameter(torch.zeros(1, num_patches, embed_dim))  # patch tokens only
        self.cls_token = nn.Parameter(torch.zeros(1, 1, embed_dim))
        self.dist_token = nn.Parameter(torch.zeros(1, 1, embed_dim)) if distill_token else None
        dpr = [drop_path_rate * i / max(depth - 1, 1) for i in range(depth)]  # linear stochastic-depth rule
        self.blocks = nn.ModuleList(
            Block(embed_dim, num_heads, mlp_ratio, qkv_bias, dpr[i], i < local_up_to_layer, grid_size,
                  locality_strength, gpsa_impl)
            for i in range(depth)
        )
        self.norm = nn.LayerNorm(embed_dim, eps=1e-6)
        self.head = nn.Linear(embed_dim, num_classes)
        self.head_dist = nn.Linear(embed_dim, num_classes) if distill_token else None
        if self.pos_embed.device.type != "meta":
            self.init_weights()

    # -- initialisation ------------------------------------------------------------------------
    @torch.no_grad()
    def init_weights(self) -> None:
        """Initialise every parameter and buffer; safe after ``to_empty`` and on FSDP2 shards."""
        trunc_normal_(self.pos_embed, std=0.02)
        trunc_normal_(self.cls_token, std=0.02)
        if self.dist_token is not None:
            trunc_normal_(self.dist_token, std=0.02)
        self.patch_embed.proj.reset_parameters()
        for blk in self.blocks:
            for norm in (blk.norm1, blk.norm2):
                nn.init.ones_(norm.weight)
                nn.init.zeros_(norm.bias)
            for lin in (blk.mlp.fc1, blk.mlp.fc2):
                trunc_normal_(lin.weight, std=0.02)
                nn.init.zeros_(lin.bias)
            if isinstance(blk.attn, GPSA):
                blk.attn.reset_buffers()
                blk.attn.init_weights(conv_init=self.conv_init, train_gating=self.train_gating)
            else:
                blk.attn.init_weights()
        nn.init.ones_(self.norm.weight)
        nn.init.zeros_(self.norm.bias)
        for head in (self.head, self.head_dist):
            if head is not None:
                trunc_normal_(head.weight, std=0.02)
                nn.init.zeros_(head.bias)
        self.apply_freezing()

    def apply_freezing(self) -> None:
        """Table 3 switches: frozen gating (lambda = 0) and frozen GPSA attention."""
        for blk in self.gpsa_blocks():
            blk.attn.gating_param.requires_grad_(self.train_gating and not self.freeze_gpsa)
            if self.freeze_gpsa:  # only the MLPs of these blocks learn
                for p in list(blk.norm1.parameters()) + list(blk.attn.parameters()):
                    p.requires_grad_(False)

    def gpsa_blocks(self) -> list[Block]:
        return [b for b in self.blocks if b.use_gpsa]

    def set_gpsa_impl(self, impl: GpsaImpl) -> None:
        for blk in self.gpsa_blocks():
            blk.attn.impl = impl

    def set_grad_checkpointing(self, enable: bool = True) -> None:
        """Activation checkpointing per block (recompute each block in backward)."""
        self.grad_checkpointing = enable

    @property
    def grid_size(self) -> int:
        return self.patch_embed.grid_size[0]

    def no_weight_decay(self) -> set[str]:
        """Parameters trained without weight decay besides biases and norms (DeiT's recipe)."""
        names = {"pos_embed", "cls_token", "dist_token"}
        names |= {f"blocks.{i}.attn.gating_param" for i, b in enumerate(self.blocks) if b.use_gpsa}
        return names

    # -- forward -------------------------------------------------------------------------------
    def _prefix_tokens(self, batch: int) -> torch.Tensor:
        tokens = [self.cls_token.expand(batch, -1, -1)]
        if self.dist_token is not None:
            tokens.append(self.dist_token.expand(batch, -1, -1))
        return torch.cat(tokens, dim=1)  # (B, 1 or 2, D)

    def drop_path_keep(self, seeds: torch.Tensor) -> torch.Tensor | None:
        """The drop-path decisions of a batch from its samples' seeds (int64 (B,), on the host): float32
        (depth, 2, B), 1 where block b keeps the sample's attention (0) or MLP (1) branch, drawn with probability
        1 - p_b from the sample's seed alone; None when the model drops no path. Computed on the host (a few bytes per
        sample), so the step moves it to the device with its other per-sample values in one copy."""
        rates = torch.tensor([blk.drop_path.drop_prob for blk in self.blocks], dtype=torch.float64)
        if not bool((rates > 0).any()):
            return None
        counters = DROP_PATH_COUNTER + torch.arange(2 * len(self.blocks), dtype=torch.int64)
        u = srl(draw(keys_of(seeds.cpu())[None, :], counters[:, None]), 11).to(torch.float64) * 2.0 ** -53
        keep = u.view(len(self.blocks), 2, -1) < (1.0 - rates).view(-1, 1, 1)
        return keep.to(torch.float32)

    def forward_features(self, x: torch.Tensor, return_layers: bool = False,
                         drop_path_keep: torch.Tensor | None = None):
        """(B, C, H, W) -> (B, T, D) after the final norm; with ``return_layers`` also every block's
        output (patch tokens only, (B, L, D)), for representation analyses. ``drop_path_keep``: (depth, 2, B) from
        ``drop_path_keep`` (else, in training, drop-path draws from the global generator)."""
        x = self.patch_embed(x) + self.pos_embed  # (B, L, D)
        layers = []
        for i, blk in enumerate(self.blocks):
            if i == self.local_up_to_layer:  # GPSA only ever sees the L patch tokens
                x = torch.cat((self._prefix_tokens(x.shape[0]), x), dim=1)  # (B, T, D)
            keep = None if drop_path_keep is None else drop_path_keep[i]
            if self.grad_checkpointing and self.training and torch.is_grad_enabled():
                x = checkpoint(blk, x, keep, use_reentrant=False)
            else:
                x = blk(x, keep)
            if return_layers:
                layers.append(x[:, -self.patch_embed.num_patches :])
        x = self.norm(x)
        return (x, layers) if return_layers else x

    def forward_head(self, x: torch.Tensor):
        logits = self.head(x[:, 0])
        if self.head_dist is None:
            return logits
        logits_dist = self.head_dist(x[:, 1])
        if self.training:  # DeiT: both heads train; the distillation head learns from the teacher
            return logits, logits_dist
        return (logits + logits_dist) / 2

    def forward(self, x: torch.Tensor, drop_path_keep: torch.Tensor | None = None):
        return self.forward_head(self.forward_features(x, drop_path_keep=drop_path_keep))

