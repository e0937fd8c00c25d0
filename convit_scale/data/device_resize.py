"""timm's RandomResizedCrop resize (PIL's bicubic) for a whole batch of differently sized boxes on the training device.

PIL's ``Image.resize(BICUBIC)`` (``libImaging/Resample.c``, followed step for step by ``resample.py`` on the CPU) is
separable: a horizontal pass, then a vertical one, each a weighted sum over a support that grows with the
downscaling factor (antialiasing), with per-output weights normalised to sum 1 and rounded to 22-bit fixed point, the
sum rounded to 8 bits after each pass. Here each pass is one batched matrix product over the batch padded to its
largest box, with one dense weight matrix per image (zero outside the image's taps, so the padding never counts):

    out = resize_packed(flat, sizes, 224, flips)        # flat: the boxes' HWC bytes, one after the other
    out = resize_list([img[:, t:t + h, l:l + w], ...], 224, flips)   # views of device-decoded images
    res = decode_crop_resize(jpeg_bytes, boxes, 224, flips, device)  # decode (nvJPEG on CUDA) + crop + resize

Exact, not close: the fixed-point weights are split into three 8-bit limbs (w = l2 * 2**16 + l1 * 2**8 + l0), so every
product of the float32 matrix products is an integer below 2**16 and every partial sum an integer below 2**24 (for
supports below 258 taps: boxes up to 64x the output side, ``MAX_SCALE``): exact in float32, and exact under TF32 or bf16
matmul precision too (8-bit integers are exact there). A larger box (a crop of a photograph over 14,336 pixels on a
side, for 224) is resized in a chunk of its own in float64, exact to 2**53. The limbs' sums are recombined with PIL's
rounding (``_round_limbs``). The output equals PIL's for the same pixels (``tests/test_data_device_resize.py``: 0 levels
on random sizes), up to the weights' normalising sum, which PIL adds left to right and torch in its own order (a weight
could move by one step of 2**-22; never seen).

Pillow resizes an image more than 100 times taller than wide, and shrunk vertically, vertically first
(``Image.resize``); such images (never a RandomResizedCrop box: aspect 3/4 to 4/3) are resized transposed, in
chunks of their own.

Kernel launches per call do not grow with the batch: the weights are built for all images at once, each pass is one
``bmm``, the boxes are padded by one gather of row windows. Only the memory bound splits a batch: images are sorted
by size and cut into chunks of at most ``CHUNK_BYTES`` of working memory (``bytes_per_image``: for a box padded to
H x W resized to S, about 15 HW + 12 SW + 36 HS bytes, 9.1 MB at 500 x 500 -> 224), each chunk padded to its own
largest box. A batch of 256 RandomResizedCrop boxes of ImageNet-sized images (500 x 375) is one chunk of 255 and one
of 1 at the default 2 GiB. An image over the budget alone (a crop tens of thousands of pixels wide) is a chunk of its
own whose first pass runs over blocks of rows (``_pass_rows``).
"""

from __future__ import annotations

import re
import warnings
from dataclasses import dataclass, field

import numpy as np
import torch
from torchvision.io import ImageReadMode, decode_jpeg

from .device_augment import to_device
from .faults import DECODE_ERRORS, DataError, pil_rgb, reason_of

CHUNK_BYTES = 2 << 30
"""Working memory of one chunk of a batch (float32 padded boxes, weights, the passes' outputs): see the docstring."""

PRECISION_BITS = 22
"""PIL's fixed point for 8-bit images (``resample.PRECISION_BITS``)."""

LIMBS = 3
"""The 8-bit limbs of a 22-bit weight (signed top limb)."""

MAX_SCALE = 64
"""The largest downscaling factor resized in float32: PIL's bicubic then has 2 * ceil(2 * 64) + 1 = 257 taps, whose
limb sums (257 x 255 x 255) stay below 2**24, float32's exact integers. Larger boxes are resized in float64 (chunks of
their own: ``_chunks``)."""

TALL = 100
"""PIL resizes an image more than this many times taller than wide (and shrunk vertically) vertically first."""


def bytes_per_image(height: int, width: int, size: int, wide: bool = False) -> int:
    """Peak working bytes of one image padded to ``height`` x ``width`` resized to ``size`` (H, W, S): the largest of
    pass 1's product (uint8 box 3HW, float32 box 12HW, limb weights 12SW, output 36HS), its rounding (output and the
    8-bit image 12HS), pass 2's product (that image, weights 12SH, output 36SS) and its rounding (12SS more); twice
    that for a ``wide`` image (``_Kind.wide``: float64 passes)."""
    h, w, s = height, width, size
    return (1 + wide) * max(15 * h * w + 12 * s * w + 36 * h * s, 48 * h * s, 24 * h * s + 36 * s * s, 48 * s * s)


# ---------------------------------------------------------------------------------------------------------
# Weights: PIL's precompute_coeffs + normalize_coeffs_8bpc for every image at once
# ---------------------------------------------------------------------------------------------------------

def _bicubic(x: torch.Tensor) -> torch.Tensor:
    """PIL's bicubic_filter (a = -0.5), operation for operation in float64 (no fused multiply-add: one op each)."""
    x = x.abs()
    near = ((1.5 * x - 2.5) * x) * x + 1
    far = (((x - 5) * x + 8) * x - 4) * -0.5
    return torch.where(x < 1.0, near, torch.where(x < 2.0, far, torch.zeros_like(x)))


def _taps(in_sizes: torch.Tensor, size: int, taps: int, reverse: torch.Tensor | None):
    """Per image and output sample: the first input index (n, S, 1) float64, and the fixed-point weights of its
    ``taps`` inputs from there (n, S, taps) int64, zero past the image's edge. ``reverse``: (n,) bool, output order
    reversed (a flip after the resize)."""
    dev = in_sizes.device
    # a division by a tensor on the device: CUDA divides by a number as a multiplication by its reciprocal, whose
    # last bit moves some boxes' first tap or weights against PIL's in_size / out_size
    scale = (in_sizes.double() / in_sizes.new_full((), size, dtype=torch.float64)).view(-1, 1)  # (n, 1)
    filterscale = scale.clamp(min=1.0)
    support = 2.0 * filterscale
    out = torch.arange(size, dtype=torch.float64, device=dev).view(1, -1)
    if reverse is not None:
        out = torch.where(reverse.view(-1, 1), (size - 1) - out, out)
    center = (out + 0.5) * scale  # (n, S)
    xmin = (center - support + 0.5).trunc().clamp(min=0.0)  # C's (int) truncates toward zero
    xmax = torch.minimum((center + support + 0.5).trunc(), in_sizes.double().view(-1, 1))
    x = xmin.unsqueeze(-1) + torch.arange(taps, dtype=torch.float64, device=dev)  # (n, S, taps) input positions
    w = _bicubic((x - center.unsqueeze(-1) + 0.5) * (1.0 / filterscale).unsqueeze(-1))
    w = torch.where(x < xmax.unsqueeze(-1), w, torch.zeros_like(w))
    total = w.sum(-1, keepdim=True)
    w = torch.where(total != 0.0, w / total, w)
    fixed = torch.where(w < 0, w * (1 << PRECISION_BITS) - 0.5, w * (1 << PRECISION_BITS) + 0.5).trunc().long()
    return xmin.unsqueeze(-1), fixed


def _limb_matrix(in_sizes: torch.Tensor, padded: int, size: int, taps: int, reverse: torch.Tensor | None,
                 dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """(n, LIMBS * S, padded) ``dtype``: row l * S + o holds limb l of output o's weights at its inputs' columns."""
    start, fixed = _taps(in_sizes, size, taps, reverse)
    limbs = torch.stack([fixed & 255, (fixed >> 8) & 255, fixed >> 16], 1).to(dtype)  # (n, L, S, taps)
    cols = (start + torch.arange(taps, dtype=torch.float64, device=start.device)).long().clamp(max=padded - 1)
    n = fixed.shape[0]
    dense = torch.zeros((n, LIMBS, size, padded), dtype=dtype, device=start.device)
    dense.scatter_add_(3, cols.unsqueeze(1).expand(n, LIMBS, size, taps), limbs)  # clamped taps add 0
    return dense.view(n, LIMBS * size, padded)


def _round_limbs(p0: torch.Tensor, p1: torch.Tensor, p2: torch.Tensor) -> torch.Tensor:
    """PIL's clip8((p2 * 2**16 + p1 * 2**8 + p0 + 2**21) >> 22) from the limbs' exact float32 sums, without leaving
    float32: carry p0 into p1 and p1 into p2 (each floor exact), then floor((p2' + 32) / 64) (the rest < 2**16 only
    adds a fraction below 1 to an integer)."""
    q = p0.div(256)
    q.floor_().add_(p1).div_(256).floor_().add_(p2).add_(32).div_(64).floor_()
    return q.clamp_(0.0, 255.0)


# ---------------------------------------------------------------------------------------------------------
# The two passes over one chunk
# ---------------------------------------------------------------------------------------------------------

def _resize_chunk(boxes: torch.Tensor, hs: torch.Tensor, ws: torch.Tensor, size: int, flips: torch.Tensor | None,
                  taps: tuple[int, int], kind: _Kind, budget: int | None = None) -> torch.Tensor:
    """boxes uint8 (n, 3, H, W) padded (any strides), hs/ws (n,) int64 on the device -> (n, 3, S, S) with uint8
    values, float32 (float64 for a ``kind.wide`` chunk). ``kind.tall``: the vertical pass first (PIL's rule for very
    tall images), as the horizontal-first resize of the transposed boxes, transposed back."""
    if kind.tall:
        boxes, hs, ws, taps = boxes.transpose(2, 3), ws, hs, taps[::-1]
    with torch.autocast(boxes.device.type, enabled=False):  # the sums reach 1.7e7: fp16 overflows, bf16 rounds
        return _resize_passes(boxes, hs, ws, size, flips, taps, kind.tall,
                              torch.float64 if kind.wide else torch.float32, budget)


def _resize_passes(boxes, hs, ws, size, flips, taps, transposed, dtype, budget=None):
    n, _, h, w = boxes.shape
    weights = _limb_matrix(ws, w, size, taps[1], None if transposed else flips, dtype)
    rows = _pass_rows(n, h, w, size, dtype, budget)
    mid = None if rows == h else torch.empty((n, h * 3, size), dtype=dtype, device=boxes.device)
    for top in range(0, h, rows):  # one block of rows, but for one image whose pass alone is over the budget
        block = boxes[:, :, top:top + rows]
        x = torch.empty((n, block.shape[2], 3, w), dtype=dtype, device=boxes.device)
        x.copy_(block.permute(0, 2, 1, 3))  # rows (y, channel): pass 1 contracts columns, pass 2 rows
        p = torch.bmm(x.view(n, -1, w), weights.transpose(1, 2))  # (n, 3 rows, L * S)
        del x
        p = p.view(n, -1, LIMBS, size)
        part = _round_limbs(p[:, :, 0], p[:, :, 1], p[:, :, 2])  # (n, 3 rows, S): PIL's 8-bit intermediate image
        del p
        if mid is None:
            mid = part
        else:
            mid[:, 3 * top:3 * top + part.shape[1]] = part
    del weights
    weights = _limb_matrix(hs, h, size, taps[0], flips if transposed else None, dtype)
    q = torch.bmm(weights, mid.view(n, h, 3 * size))  # (n, L * S, 3S)
    del mid, weights
    q = q.view(n, LIMBS, size, 3 * size)
    out = _round_limbs(q[:, 0], q[:, 1], q[:, 2]).view(n, size, 3, size).permute(0, 2, 1, 3)  # (n, 3, S, S)
    return out.transpose(2, 3) if transposed else out


def _pass_rows(n: int, h: int, w: int, size: int, dtype: torch.dtype, budget: int | None) -> int:
    """Rows of the first pass at a time: all of them, unless the chunk is one image whose working memory is over
    ``budget`` (a box too large for any chunk: a photograph's crop tens of thousands of pixels wide, in float64);
    then as many as keep each block's float copy, product and rounding (about 3 x (W + 5S) values a row) within
    it, and the 8-bit intermediate image is filled block by block."""
    itemsize = torch.finfo(dtype).bits // 8
    if budget is None or n != 1 or bytes_per_image(h, w, size, wide=itemsize == 8) <= budget:
        return h
    return max(1, min(h, budget // (3 * (w + (LIMBS + 2) * size) * itemsize)))


def _taps_of(in_max: int, size: int) -> int:
    """PIL's ksize for the largest input of a chunk: every image's taps fit."""
    return int(np.ceil(2.0 * max(in_max / size, 1.0))) * 2 + 1


@dataclass(frozen=True)
class _Kind:
    """What a chunk's images share: ``tall``, PIL's vertical-first rule (``TALL``); ``wide``, a side over
    ``MAX_SCALE`` x the output's (float64 passes, twice the working memory)."""

    tall: bool
    wide: bool


def _chunks(hs: np.ndarray, ws: np.ndarray, size: int, budget: int) -> list[tuple[np.ndarray, _Kind]]:
    """(image indices, kind) per chunk: each group of one ``_Kind`` sorted by size and cut greedily where the next
    image would take the chunk's padded working memory above ``budget`` (host ints, O(B))."""
    tall = (hs > TALL * ws) & (hs > size)
    wide = np.maximum(hs, ws) > MAX_SCALE * size
    chunks = []
    for kind in (_Kind(False, False), _Kind(True, False), _Kind(False, True), _Kind(True, True)):
        idx = np.flatnonzero((tall == kind.tall) & (wide == kind.wide))
        idx = idx[np.lexsort((ws[idx], hs[idx]))]
        current, hmax, wmax = [], 0, 0
        for i in idx.tolist():
            h2, w2 = max(hmax, int(hs[i])), max(wmax, int(ws[i]))
            pad_h, pad_w = (w2, h2) if kind.tall else (h2, w2)
            if current and (len(current) + 1) * bytes_per_image(pad_h, pad_w, size, kind.wide) > budget:
                chunks.append((np.array(current), kind))
                current, h2, w2 = [], int(hs[i]), int(ws[i])
            current.append(i)
            hmax, wmax = h2, w2
        if current:
            chunks.append((np.array(current), kind))
    return chunks


# ---------------------------------------------------------------------------------------------------------
# Images as rows of one flat buffer
# ---------------------------------------------------------------------------------------------------------

@dataclass
class _Rows:
    """A batch of images in one flat uint8 buffer: image i's pixel (c, y, x) at
    ``base[i] + c * pitch_c[i] + y * pitch_y[i] + x * step`` (``step`` 3 for HWC rows, 1 for CHW planes).
    ``flat`` must extend at least ``(max width - 1) * step`` bytes past the last image's last pixel."""

    flat: torch.Tensor
    step: int
    hs: np.ndarray
    ws: np.ndarray
    base: np.ndarray
    pitch_c: np.ndarray
    pitch_y: np.ndarray
    table: torch.Tensor = field(init=False)


def _gather(rows: _Rows, idx: torch.Tensor, h: int, w: int) -> torch.Tensor:
    """The images ``idx`` (device int64) padded to (n, 3, h, w) uint8: one gather of row windows of ``w`` pixels over
    the flat buffer (padding rows repeat an image's last row; padding columns hold whatever follows a row)."""
    t = rows.table.index_select(0, idx)  # (n, 5): base, pitch_c, pitch_y, height, width
    y = torch.arange(h, device=idx.device).view(1, 1, h)
    y = torch.minimum(y, t[:, 3].view(-1, 1, 1) - 1)
    c = torch.arange(3, device=idx.device).view(1, 3, 1)
    starts = t[:, 0].view(-1, 1, 1) + c * t[:, 1].view(-1, 1, 1) + y * t[:, 2].view(-1, 1, 1)  # (n, 3, h)
    flat = rows.flat
    windows = flat.as_strided((flat.numel() - (w - 1) * rows.step, w), (1, rows.step), flat.storage_offset())
    return windows.index_select(0, starts.view(-1)).view(-1, 3, h, w)


def _resize_rows(rows: _Rows, size: int, flips: torch.Tensor | None, out_dtype: torch.dtype,
                 budget: int) -> torch.Tensor:
    """Every image of ``rows`` resized to ``size`` (PIL's bicubic), flipped where ``flips``: (B, 3, S, S)."""
    dev, n = rows.flat.device, len(rows.hs)
    chunks = _chunks(rows.hs, rows.ws, size, budget)
    order = np.concatenate([c for c, _ in chunks]) if chunks else np.zeros(0, np.int64)
    table = torch.from_numpy(np.stack([rows.base, rows.pitch_c, rows.pitch_y, rows.hs, rows.ws], 1).astype(np.int64))
    table, order_dev = to_device([table, torch.from_numpy(order.astype(np.int64))], dev)
    rows.table = table
    if flips is not None:
        flips = flips.to(dev, non_blocking=True)
    out = torch.empty((n, 3, size, size), dtype=out_dtype, device=dev)
    start = 0
    for idx, kind in chunks:
        sel = order_dev[start:start + len(idx)]
        start += len(idx)
        h, w = int(rows.hs[idx].max()), int(rows.ws[idx].max())
        boxes = _gather(rows, sel, h, w)
        sub = table.index_select(0, sel)
        resized = _resize_chunk(boxes, sub[:, 3], sub[:, 4], size, None if flips is None else flips[sel],
                                (_taps_of(h, size), _taps_of(w, size)), kind, budget)
        out.index_copy_(0, sel, resized.to(out_dtype))
    return out


def _check_size(size: int) -> None:
    if not isinstance(size, int) or size < 1:
        raise ValueError(f"size={size!r}: must be a positive int (the output side in pixels)")


def _check_flips(flips, n: int) -> None:
    if flips is not None and (not isinstance(flips, torch.Tensor) or flips.dtype != torch.bool
                              or tuple(flips.shape) != (n,)):
        got = (f"dtype={flips.dtype}, shape={tuple(flips.shape)}" if isinstance(flips, torch.Tensor)
               else type(flips).__name__)
        raise ValueError(f"flips must be None or a bool tensor of shape ({n},); got {got}")


def resize_packed(flat: torch.Tensor, sizes: torch.Tensor, size: int, flips: torch.Tensor | None = None,
                  out_dtype: torch.dtype = torch.uint8, *, chunk_bytes: int = CHUNK_BYTES) -> torch.Tensor:
    """PIL's ``Image.resize((size, size), BICUBIC)`` of every image of a packed batch, flipped horizontally after
    the resize where ``flips``.

    flat: 1-D uint8 on the training device, image i's HWC bytes (h_i, w_i, 3) after image i - 1's. sizes: int64
    (B, 2) rows (h_i, w_i); read on the host (pass them on the CPU: on a GPU they cost a synchronisation). flips:
    bool (B,) or None. Returns (B, 3, size, size) ``out_dtype`` on flat's device (uint8 values in any dtype)."""
    _check_size(size)
    if not isinstance(flat, torch.Tensor) or flat.dtype != torch.uint8 or flat.dim() != 1:
        raise ValueError(f"flat must be a 1-D uint8 tensor; got {getattr(flat, 'dtype', type(flat).__name__)}, "
                         f"shape {tuple(getattr(flat, 'shape', ()))}")
    if (not isinstance(sizes, torch.Tensor) or sizes.dim() != 2 or sizes.shape[1] != 2
            or sizes.dtype.is_floating_point or sizes.dtype == torch.bool):
        raise ValueError(f"sizes must be an int tensor of shape (B, 2), rows (height, width); got "
                         f"{tuple(getattr(sizes, 'shape', ()))}")
    hw = sizes.detach().cpu().numpy().astype(np.int64)
    n = hw.shape[0]
    _check_flips(flips, n)
    if n and hw.min() < 1:
        raise ValueError(f"sizes: every height and width must be >= 1; got {hw[hw.min(1) < 1][0].tolist()}")
    need = int((hw[:, 0] * hw[:, 1]).sum()) * 3
    if flat.numel() != need:
        raise ValueError(f"flat holds {flat.numel()} bytes; sizes describe {need} (sum of h * w * 3)")
    if n == 0:
        return torch.empty((0, 3, size, size), dtype=out_dtype, device=flat.device)
    lengths = hw[:, 0] * hw[:, 1] * 3
    base = np.concatenate([[0], np.cumsum(lengths)[:-1]])
    tail = int((hw[:, 1].max() - 1) * 3)
    padded = torch.cat([flat, flat.new_zeros(tail)]) if tail else flat
    rows = _Rows(padded, 3, hw[:, 0], hw[:, 1], base, np.ones(n, np.int64), hw[:, 1] * 3)
    return _resize_rows(rows, size, flips, out_dtype, chunk_bytes)


def _chw_strides(img: torch.Tensor, layout: str) -> tuple[int, int, int, int, int]:
    """(height, width, stride of channel, row, column) of a 3-channel uint8 image, CHW or HWC (``layout`` auto:
    CHW when the first dimension is 3, else HWC)."""
    if not isinstance(img, torch.Tensor) or img.dtype != torch.uint8 or img.dim() != 3:
        raise ValueError(f"images must be 3-D uint8 tensors (3, H, W) or (H, W, 3); got "
                         f"{getattr(img, 'dtype', type(img).__name__)}, shape {tuple(getattr(img, 'shape', ()))}")
    chw = layout == "CHW" or (layout == "auto" and img.shape[0] == 3)
    if (img.shape[0] if chw else img.shape[2]) != 3 or img.numel() == 0:
        raise ValueError(f"images must have 3 channels and pixels, (3, H, W) or (H, W, 3); got {tuple(img.shape)}")
    s = img.stride()
    return (img.shape[1], img.shape[2], s[0], s[1], s[2]) if chw else (img.shape[0], img.shape[1], s[2], s[0], s[1])


def resize_list(images: list[torch.Tensor], size: int, flips: torch.Tensor | None = None,
                out_dtype: torch.dtype = torch.uint8, *, layout: str = "auto",
                chunk_bytes: int = CHUNK_BYTES) -> torch.Tensor:
    """``resize_packed`` for a list of uint8 images on one device, CHW (as ``torchvision.io.decode_jpeg`` returns
    them) or HWC (``layout``: auto, CHW or HWC), views such as crops of decoded images included.

    No per-image kernel where the images share a pixel step (all CHW planes, or all HWC rows): each image's bytes
    (the memory span its view covers: each plane's, for CHW) are copied by one ``torch.cat`` into one buffer, and
    the boxes read from there by offsets and strides. An image of the other step is first made contiguous (a copy
    of its own)."""
    _check_size(size)
    if layout not in ("auto", "CHW", "HWC"):
        raise ValueError(f"layout={layout!r}: allowed: auto, CHW, HWC")
    _check_flips(flips, len(images))
    if not images:
        return torch.empty((0, 3, size, size), dtype=out_dtype)
    dev = images[0].device
    if any(img.device != dev for img in images):
        raise ValueError(f"images must be on one device; got {sorted({str(i.device) for i in images})}")
    geo = [_chw_strides(img, layout) for img in images]
    step = geo[0][4] if geo[0][4] in (1, 3) else 1
    images = list(images)
    for i, (_, _, sc, _, sx) in enumerate(geo):
        if sx != step or (step == 3 and sc != 1):  # the other layout: a copy in this one
            chw = images[i] if layout == "CHW" or (layout == "auto" and images[i].shape[0] == 3) \
                else images[i].permute(2, 0, 1)
            images[i] = chw.contiguous() if step == 1 else chw.permute(1, 2, 0).contiguous().permute(2, 0, 1)
            geo[i] = _chw_strides(images[i], "CHW")
    hs = np.array([g[0] for g in geo], np.int64)
    ws = np.array([g[1] for g in geo], np.int64)
    if step == 1:  # planes: each plane's span alone (a crop's span across its planes is most of its whole image)
        plane = [1 + (g[0] - 1) * g[3] + (g[1] - 1) for g in geo]
        spans = [img.as_strided((e,), (1,), img.storage_offset() + c * g[2])
                 for img, g, e in zip(images, geo, plane) for c in range(3)]
        extents, pitch_c = [3 * e for e in plane], np.array(plane, np.int64)
    else:
        extents = [1 + sum((d - 1) * s for d, s in zip(img.shape, img.stride())) for img in images]
        spans = [img.as_strided((e,), (1,), img.storage_offset()) for img, e in zip(images, extents)]
        pitch_c = np.array([g[2] for g in geo], np.int64)
    tail = int((ws.max() - 1) * step)
    flat = torch.cat(spans + ([spans[0].new_zeros(tail)] if tail else []))
    base = np.concatenate([[0], np.cumsum(extents)[:-1]]).astype(np.int64)
    rows = _Rows(flat, step, hs, ws, base, pitch_c, np.array([g[3] for g in geo], np.int64))
    return _resize_rows(rows, size, flips, out_dtype, chunk_bytes)


# ---------------------------------------------------------------------------------------------------------
# Decoding on the device
# ---------------------------------------------------------------------------------------------------------

@dataclass
class Decoded:
    """What ``decode_crop_resize`` made of a batch."""

    images: torch.Tensor
    """uint8 (B, 3, size, size) on the device; zeros for the images in ``failed``."""
    refused: int
    """Payloads the device's decoder refused, or was not offered (``device_decodable``), that the CPU (PIL) decoded:
    their pixels are PIL's."""
    failed: dict[int, str] = field(default_factory=dict)
    """Batch index -> reason, for bytes no decoder could read (for the loader's replacement rule, ``faults.py``)."""


# torchvision 0.29 warns on every decode that torchcodec succeeds it (not installed here, nor nvImageCodec or DALI):
# said once here, not per batch (a filter of its own: warnings.catch_warnings is not thread-safe)
warnings.filterwarnings("ignore", "The image decoding and encoding capabilities of TorchVision are deprecated",
                        DeprecationWarning)


def _decode(data: list[torch.Tensor], device: torch.device) -> list[torch.Tensor]:
    """The device's decoder, one batched call: torchvision's ``decode_jpeg`` of a list in RGB (greyscale and CMYK
    converted), nvJPEG on CUDA, libjpeg-turbo on the CPU. (3, H, W) uint8 images on ``device``."""
    return decode_jpeg(data, mode=ImageReadMode.RGB, device=device)


NVJPEG_DEVICE_FAILURE = re.compile(
    r"out of memory|CUDA ERROR|cuda\w+ failed|Failed to (synchronize|initialize|create|attach)"
    r"|Failed to (decode batch|decode jpeg stream|parse jpeg stream|get image info|transfer jpeg to device): "
    r"(1|5|7)\b|not compiled with nvjpeg", re.IGNORECASE)
"""torchvision's messages (its CUDA decoder, 0.19-0.29) for a failure of the device or of nvJPEG's own set-up, never a
file's: CUDA errors, its streams, buffers and handles, nvJPEG's statuses NOT_INITIALIZED (1), ALLOCATOR_FAILURE (5:
nvJPEG allocates outside torch's cache, the likeliest allocation to fail when that cache holds the GPU) and
ARCH_MISMATCH (7), and a torchvision built without nvJPEG. A file's: BAD_JPEG (3), JPEG_NOT_SUPPORTED (4),
INCOMPLETE_BITSTREAM (10) and the CPU decoder's libjpeg messages."""
NVJPEG_ALLOCATION = re.compile(r": 5\b|out of memory", re.IGNORECASE)
"""A device failure of the decoder's own allocations (nvJPEG's ALLOCATOR_FAILURE, torchvision's out-of-memory): the
memory torch's cache holds free is given back to the device and the call made once more before it is raised."""


def device_fault(e: BaseException) -> bool:
    """Whether ``e`` is the device's failure, never a file's: torch's ``OutOfMemoryError`` (its caching allocator), or
    a RuntimeError of the decoder that says so (``NVJPEG_DEVICE_FAILURE``: torchvision re-raises a failure of its own
    allocations as "Error while decoding JPEG images: CUDA out of memory ...", nvJPEG's as "Failed to decode batch:
    5"). It propagates: decoding a batch on the host image by image, counted as refused files, would hide it."""
    return isinstance(e, torch.OutOfMemoryError) or bool(NVJPEG_DEVICE_FAILURE.search(str(e)))


FRAMES = (0xC0, 0xC1, 0xC2)
"""The JPEG frames the device's decoder is offered: baseline, extended and progressive Huffman (nvJPEG's batched
hardware path takes baseline, its hybrid path the others). Lossless, hierarchical and arithmetic-coded frames go to
PIL on the host, as do 12-bit samples."""


DEVICE_MAX_PIXELS = 89_478_485
"""The largest image (height x width, as its header says) offered to the device's decoder: PIL's decompression-bomb
limit (``Image.MAX_IMAGE_PIXELS``). A header that claims more goes to PIL, which refuses it or decodes it: an
allocation the device cannot make would be its failure, which ends the run, not the file's."""


def device_decodable(data: torch.Tensor) -> bool:
    """Whether a payload goes to the device's decoder: a JPEG (SOI) whose frame header, read before the first scan,
    is one of ``FRAMES`` with 8-bit samples of 1 or 3 components. A PNG or GIF under a .JPEG name fails here, with no
    device attempt (a refusal would fail the whole batched call), as does a CMYK or YCCK JPEG (4 components: nvJPEG
    refuses them unless asked, and torchvision does not ask; PIL converts them, the reference's pixels), or one whose
    header claims no pixels or more than ``DEVICE_MAX_PIXELS``, or whose 3 components are RGB, not YCbCr
    (``_rgb_components``). Reads the markers' lengths only: microseconds."""
    b = memoryview(data.numpy())
    n, i = len(b), 2
    if n < 4 or b[0] != 0xFF or b[1] != 0xD8:
        return False
    jfif, adobe = False, None
    while i + 4 <= n and b[i] == 0xFF:
        marker = b[i + 1]
        if marker == 0xFF or marker == 0x01 or 0xD0 <= marker <= 0xD7:  # fill byte, TEM, RSTn: no length
            i += 1 if marker == 0xFF else 2
            continue
        if 0xC0 <= marker <= 0xCF and marker not in (0xC4, 0xC8, 0xCC):  # SOFn (not DHT, JPG, DAC): precision,
            pixels = (b[i + 5] << 8 | b[i + 6]) * (b[i + 7] << 8 | b[i + 8]) if i + 9 < n else 0  # height x width
            return (0 < pixels <= DEVICE_MAX_PIXELS and marker in FRAMES  # (0: the header is cut short)
                    and b[i + 4] == 8 and b[i + 9] in (1, 3)  # 8-bit samples, 1 or 3 components
                    and not (b[i + 9] == 3 and _rgb_components(b, i, jfif, adobe)))
        if marker in (0xD9, 0xDA):  # EOI or the first scan: no frame header before it
            return False
        if marker == 0xE0 and bytes(b[i + 4:i + 9]) == b"JFIF\0":
            jfif = True
        elif marker == 0xEE and bytes(b[i + 4:i + 9]) == b"Adobe" and i + 15 < n:
            adobe = b[i + 15]  # its transform: 0 RGB (or CMYK), 1 YCbCr, 2 YCCK
        i += 2 + (b[i + 2] << 8 | b[i + 3])
    return False


def _rgb_components(b: memoryview, sof: int, jfif: bool, adobe: int | None) -> bool:
    """Whether libjpeg (PIL's decoder, the reference) reads a 3-component frame as RGB rather than YCbCr: no JFIF
    marker, and an Adobe marker's transform 0, or without one the component ids 'R', 'G', 'B' (``jdapimin.c``'s
    rule). Such files (Pillow writes them with ``keep_rgb``) go to PIL: whether nvJPEG honours the same rule is
    not part of its documented behaviour, and a colour transform it applied to RGB samples would pass silently."""
    if jfif:
        return False
    if adobe is not None:
        return adobe == 0
    return sof + 17 <= len(b) and (b[sof + 10], b[sof + 13], b[sof + 16]) == (82, 71, 66)


def _decode_accepted(encoded: list[torch.Tensor], idx: list[int], device: torch.device, out: dict,
                     refused: list[int]) -> None:
    """The payloads ``idx`` decoded by the device's decoder into ``out`` (index -> image), in one batched call. A
    batch it refuses (a file corrupt past its header: nvJPEG and libjpeg-turbo fail the whole call) is halved, and
    each half decoded batched again, until each refused file is alone (in ``refused``): a few calls more for one
    bad file, never a call per image. A failure of the device (``device_fault``) is not a file's: it propagates."""
    if not idx:
        return
    try:
        out.update(zip(idx, _retried_decode([encoded[i] for i in idx], device)))
    except RuntimeError as e:
        if device_fault(e):
            raise
        if device.type == "cuda":  # the decoder may have raised before its own stream finished: nothing of this
            torch.cuda.synchronize(device)  # call still writes when its halves allocate; a broken context raises here
        if len(idx) == 1:
            refused.append(idx[0])
            return
        half = len(idx) // 2
        _decode_accepted(encoded, idx[:half], device, out, refused)
        _decode_accepted(encoded, idx[half:], device, out, refused)


def _retried_decode(data: list[torch.Tensor], device: torch.device) -> list[torch.Tensor]:
    """``_decode``, made once more after a failure of the decoder's own allocations (``NVJPEG_ALLOCATION``) with the
    free blocks of torch's cache given back to the device first: nvJPEG's buffers grow outside that cache (a later
    batch of larger files), which may hold the free memory they need. torch's own out-of-memory error already
    followed such a release, and is raised."""
    try:
        return _decode(data, device)
    except RuntimeError as e:
        if isinstance(e, torch.OutOfMemoryError) or not (device_fault(e) and NVJPEG_ALLOCATION.search(str(e))):
            raise
        if device.type == "cuda":
            torch.cuda.synchronize(device)
            torch.cuda.empty_cache()
        return _decode(data, device)


REFUSED_ALL_AT = 8
"""A batch of at least this many JPEGs that the device's decoder refused, every one, while PIL decoded them all: the
decoder's fault, not the files' (``decode_crops`` reports it instead of training on at PIL's pace)."""


def _check_box(i: int, box: tuple, ih: int, iw: int) -> None:
    top, left, h, w = box
    if h < 1 or w < 1 or top < 0 or left < 0 or top + h > ih or left + w > iw:
        raise ValueError(f"boxes[{i}]=(top {top}, left {left}, height {h}, width {w}) is not inside its image "
                         f"of {ih} x {iw} pixels")


def _to_device(crops: dict[int, np.ndarray], device: torch.device, rows: bool) -> dict[int, torch.Tensor]:
    """Host crops (h, w, 3) as (3, h, w) views of one buffer on ``device``, packed in the device decoder's layout (one
    pixel step for ``resize_list``: HWC ``rows`` as torchvision's CPU decoder gives them, else CHW planes as nvJPEG's)
    into one page-locked buffer on CUDA, moved in one copy."""
    packed = {i: np.ascontiguousarray(c if rows else c.transpose(2, 0, 1)) for i, c in crops.items()}
    if not packed:
        return {}
    host = torch.empty(sum(p.size for p in packed.values()), dtype=torch.uint8, pin_memory=device.type == "cuda")
    np.concatenate([p.reshape(-1) for p in packed.values()], out=host.numpy())
    flat, views, at = host.to(device, non_blocking=True), {}, 0
    for i, p in packed.items():
        view = flat[at:at + p.size].view(p.shape)
        views[i], at = view.permute(2, 0, 1) if rows else view, at + p.size
    return views


def _host_crops(encoded: list[torch.Tensor], boxes: list, idx: list[int], pixels: dict,
                failed: dict[int, str]) -> tuple[dict[int, np.ndarray], int]:
    """The boxes of ``idx`` cut on the host: from ``pixels`` (decoded by the loader), else decoded by PIL (counted);
    a payload PIL cannot read either is listed in ``failed`` and stands in as one black pixel. Returns (crops,
    JPEGs PIL decoded)."""
    crops, decoded = {}, 0
    for i in idx:
        if i in pixels:
            rgb = pixels[i]
        else:
            try:
                rgb = np.asarray(pil_rgb(encoded[i].numpy().tobytes()))
            except DECODE_ERRORS as e:
                failed[i], crops[i] = reason_of(e), np.zeros((1, 1, 3), np.uint8)
                continue
            decoded += 1
        _check_box(i, boxes[i], rgb.shape[0], rgb.shape[1])
        top, left, h, w = boxes[i]
        crops[i] = rgb[top:top + h, left:left + w]
    return crops, decoded


def decode_crop_resize(encoded: list[torch.Tensor], boxes: torch.Tensor, size: int,
                       flips: torch.Tensor | None, device: torch.device | str,
                       pixels: dict[int, np.ndarray] | None = None, broken: list[str] | None = None) -> Decoded:
    """Decode a batch of JPEGs on ``device``, crop each to its box and resize the boxes to ``size`` (PIL's bicubic,
    ``resize_list``), flipped where ``flips``: ``decode_crops``, then one ``resize_list`` of every box.

    encoded: 1-D uint8 CPU tensors, a JPEG's bytes each. boxes: int64 (B, 4) rows (top, left, height, width) in
    the full image's pixels. pixels: {index: (H, W, 3) uint8 host image} of views the loader decoded (not JPEGs;
    their ``encoded`` entries are not read). broken: as ``decode_crops`` takes it. An out-of-memory error
    propagates."""
    device = torch.device(device)
    _check_size(size)
    _check_flips(flips, len(encoded))
    return resized(*decode_crops(encoded, boxes, device, pixels, broken), size, flips, device)


def resized(crops: list[torch.Tensor], refused: int, failed: dict[int, str], size: int, flips: torch.Tensor | None,
            device: torch.device) -> Decoded:
    """``decode_crops``'s crops resized to ``size`` in one ``resize_list`` (a failed view's black pixel: zeros), on
    ``device`` however few."""
    if not crops:
        return Decoded(torch.empty((0, 3, size, size), dtype=torch.uint8, device=device), refused, failed)
    return Decoded(resize_list(crops, size, flips, layout="CHW"), refused, failed)


def decode_crops(encoded: list[torch.Tensor], boxes: torch.Tensor, device: torch.device,
                 pixels: dict[int, np.ndarray] | None = None,
                 broken: list[str] | None = None) -> tuple[list[torch.Tensor], int, dict[int, str]]:
    """The boxes of a batch of JPEGs on ``device``, uint8 (3, h, w) views (``decode_crop_resize``'s arguments),
    the count PIL decoded on the host (``Decoded.refused``) and the failed ones (``Decoded.failed``). The JPEGs that
    pass ``device_decodable`` are decoded by one ``torchvision.io.decode_jpeg(list, device=device)`` call
    (``_decode_accepted``: halved where the decoder fails the call); the others, and those it refused, by PIL on
    the host, their boxes moved with the loader-decoded ones in one copy; bytes PIL cannot read either stand in as
    one black pixel. A decoder that refused the whole batch (``REFUSED_ALL_AT``) raises :class:`DataError`, or, with
    ``broken``, is appended to it (the training step raises it on every rank alike) and the batch is PIL's."""
    pixels = pixels or {}
    if not isinstance(boxes, torch.Tensor) or tuple(boxes.shape) != (len(encoded), 4):
        raise ValueError(f"boxes must be an int tensor of shape ({len(encoded)}, 4), rows (top, left, height, "
                         f"width); got {tuple(getattr(boxes, 'shape', ()))}")
    for i, data in enumerate(encoded):
        if not isinstance(data, torch.Tensor) or data.dtype != torch.uint8 or data.dim() != 1 or data.is_cuda:
            raise ValueError(f"encoded[{i}] must be a 1-D uint8 CPU tensor of a JPEG's bytes")
    if not encoded:
        return [], 0, {}
    box_list = [tuple(b) for b in boxes.detach().cpu().tolist()]
    accepted = [i for i in range(len(encoded)) if i not in pixels and device_decodable(encoded[i])]
    on_device, refused = {}, []
    _decode_accepted(encoded, accepted, device, on_device, refused)
    failed: dict[int, str] = {}
    host, decoded = _host_crops(encoded, box_list, [i for i in range(len(encoded)) if i not in on_device], pixels,
                                failed)
    if len(accepted) >= REFUSED_ALL_AT and len(refused) == len(accepted) and not failed.keys() & set(refused):
        why = (f"the device's decoder ({device}) refused all {len(refused)} JPEGs of a batch that PIL decodes: a "
               f"fault of the decoder or of its installation (torchvision's nvJPEG), not of the files; set "
               f"data.decode_on=cpu to decode them on the host")
        if broken is None:
            raise DataError(why)
        broken.append(why)
    crops = _to_device(host, device, rows=any(img.stride(2) == 3 for img in on_device.values()))
    for i, img in on_device.items():
        _check_box(i, box_list[i], img.shape[1], img.shape[2])
        top, left, h, w = box_list[i]
        crops[i] = img[:, top:top + h, left:left + w]
    return [crops[i] for i in range(len(encoded))], decoded, failed
