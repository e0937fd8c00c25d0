"""PIL's resampling, compiled: FFCV's crops and eval views pixel for pixel as timm's transforms make them.

timm's RandomResizedCrop crops the image and resizes the crop with PIL (bicubic in the DeiT recipe); its eval
transform resizes the whole image so that its shorter side is ``floor(size / crop_ratio)`` and crops the centre
``size x size``. PIL resizes in two separable passes, horizontal then vertical, each a convolution whose support
grows with the downscaling factor (an antialiasing filter, unlike OpenCV's INTER_CUBIC), in fixed point with
22 fractional bits, rounding to uint8 after each pass (Pillow's ``libImaging/Resample.c``). The functions here
follow it step for step, so for the same pixels and the same crop box they give PIL's output exactly
(``tests/test_data_resample.py``: max difference 0 on real photographs and random boxes).

One divergence is left: Pillow resizes an image more than 100 times taller than wide vertically first. A
RandomResizedCrop box (aspect ratio 3/4 to 4/3) never is; an eval image would have to be.

Images are flat uint8 arrays (rows of ``width x 3`` bytes, RGB), as the FFCV decoders hold them.
"""

from __future__ import annotations

import math

import numba
import numpy as np

from ..splitmix_numba import cache_available

PRECISION_BITS = 22
"""Pillow's fixed point for 8-bit images: 32 - 8 bits of result - 2 bits of headroom (negative lobes, sums > 1)."""

CACHE = cache_available(lambda: 0)
"""Whether this file's compiled functions are cached on disk (``splitmix_numba.cache_available``)."""

FILTERS = {"bilinear": 1, "bicubic": 2}
"""``data.interpolation`` -> the filter number the compiled functions take (PIL's BILINEAR and BICUBIC)."""


@numba.njit(nogil=True, cache=CACHE)
def _filter(x, kind):
    """PIL's bilinear (kind 1, support 1) or bicubic (kind 2, a = -0.5, support 2) kernel."""
    if x < 0.0:
        x = -x
    if kind == 1:
        return 1.0 - x if x < 1.0 else 0.0
    a = -0.5
    if x < 1.0:
        return ((a + 2.0) * x - (a + 3.0)) * x * x + 1
    if x < 2.0:
        return (((x - 5) * x + 8) * x - 4) * a
    return 0.0


@numba.njit(nogil=True, cache=CACHE)
def _coeffs(in_size, out_size, first, count, kind):
    """Pillow's ``precompute_coeffs`` + ``normalize_coeffs_8bpc`` for outputs ``first .. first + count - 1`` of a
    resize of ``in_size`` samples to ``out_size``: per output, the first input and the number of inputs
    ((count, 2) int64), and their fixed-point weights ((count, taps) int32)."""
    scale = in_size / out_size
    filterscale = max(scale, 1.0)
    support = (1.0 if kind == 1 else 2.0) * filterscale
    taps = int(math.ceil(support)) * 2 + 1
    bounds = np.empty((count, 2), np.int64)
    weights = np.zeros((count, taps), np.int32)
    w = np.empty(taps)
    for o in range(count):
        center = (first + o + 0.5) * scale
        xmin = max(int(center - support + 0.5), 0)  # C's (int) truncates toward zero, as int() does
        xmax = min(int(center + support + 0.5), in_size) - xmin
        total = 0.0
        for x in range(xmax):
            w[x] = _filter((x + xmin - center + 0.5) / filterscale, kind)
            total += w[x]
        for x in range(xmax):
            v = w[x] / total if total != 0.0 else w[x]
            weights[o, x] = int(-0.5 + v * (1 << PRECISION_BITS)) if v < 0 else int(0.5 + v * (1 << PRECISION_BITS))
        bounds[o, 0], bounds[o, 1] = xmin, xmax
    return bounds, weights


@numba.njit(nogil=True, cache=CACHE)
def _clip8(acc):
    v = acc >> PRECISION_BITS
    return 0 if v < 0 else (255 if v > 255 else v)


@numba.njit(nogil=True, cache=CACHE)
def _horizontal(src, src_width, top, left, y0, y1, bounds, weights, mid, n_w):
    """Pass 1: rows y0 .. y1 - 1 of the region at (top, left), resampled to the window's n_w columns, into mid."""
    half = np.int32(1 << (PRECISION_BITS - 1))
    for y in range(y0, y1):
        base = ((top + y) * src_width + left) * 3
        out = (y - y0) * n_w * 3
        for o in range(n_w):
            s0 = s1 = s2 = half
            p = base + bounds[o, 0] * 3
            for x in range(bounds[o, 1]):
                k = weights[o, x]
                s0 += np.int32(src[p]) * k
                s1 += np.int32(src[p + 1]) * k
                s2 += np.int32(src[p + 2]) * k
                p += 3
            mid[out + 3 * o] = _clip8(s0)
            mid[out + 3 * o + 1] = _clip8(s1)
            mid[out + 3 * o + 2] = _clip8(s2)


@numba.njit(nogil=True, cache=CACHE)
def _vertical(mid, y0, bounds, weights, dst, n_h, row_len):
    """Pass 2: the window's n_h rows from the horizontally resampled rows in mid (rows from y0), into dst."""
    acc = np.empty(row_len, np.int32)
    half = np.int32(1 << (PRECISION_BITS - 1))
    for o in range(n_h):
        acc[:] = half
        for y in range(bounds[o, 1]):
            k = weights[o, y]
            row = (bounds[o, 0] - y0 + y) * row_len
            for c in range(row_len):  # contiguous: vectorised
                acc[c] += np.int32(mid[row + c]) * k
        out = o * row_len
        for c in range(row_len):
            dst[out + c] = _clip8(acc[c])


@numba.njit(nogil=True, cache=CACHE)
def resize_window(src, src_width, top, left, height, width, out_height, out_width, row0, col0, dst, kind, mid):
    """PIL's resize of the ``height x width`` region at (``top``, ``left``) of ``src`` (an image ``src_width``
    pixels wide) to ``out_height x out_width``, of which only the window of ``dst``'s size starting at output row
    ``row0`` and column ``col0`` is computed, into ``dst`` ((n_h, n_w, 3) uint8, contiguous). The region is the
    image the resize sees (kernels stop at its edges, as after PIL's crop). ``mid``: scratch of at least
    ``height x n_w x 3`` bytes. ``kind``: ``FILTERS``."""
    n_h, n_w = dst.shape[0], dst.shape[1]
    flat, row_len = dst.reshape(-1), n_w * 3
    v_bounds, v_weights = _coeffs(height, out_height, row0, n_h, kind)
    y0, y1 = v_bounds[0, 0], v_bounds[n_h - 1, 0] + v_bounds[n_h - 1, 1]  # the region's rows the window reads
    if out_width != width:
        h_bounds, h_weights = _coeffs(width, out_width, col0, n_w, kind)
        _horizontal(src, src_width, top, left, y0, y1, h_bounds, h_weights, mid, n_w)
    else:  # PIL skips an identity pass (its weights would be exactly 0, 1, 0)
        for y in range(y0, y1):
            start = ((top + y) * src_width + left + col0) * 3
            mid[(y - y0) * row_len:(y - y0 + 1) * row_len] = src[start:start + row_len]
    if out_height != height:
        _vertical(mid, y0, v_bounds, v_weights, flat, n_h, row_len)
    else:
        start = (row0 - y0) * row_len
        flat[:] = mid[start:start + n_h * row_len]
    return dst


@numba.njit(nogil=True, cache=CACHE)
def resized_crop(src, src_width, i, j, h, w, dst, kind, mid):
    """timm's RandomResizedCrop after its box is drawn: ``F.resized_crop(img, i, j, h, w, size)``, i.e. the crop
    ``h x w`` at row ``i``, column ``j``, resized to ``dst``'s size."""
    return resize_window(src, src_width, i, j, h, w, dst.shape[0], dst.shape[1], 0, 0, dst, kind, mid)


@numba.njit(nogil=True, cache=CACHE)
def _half_even(x2):
    """round(x2 / 2) with Python's (and torchvision's) rounding of halves to even."""
    q = x2 // 2
    if x2 % 2 == 1 and q % 2 == 1:
        q += 1
    return q


@numba.njit(nogil=True, cache=CACHE)
def resized_center_crop(src, height, width, short_side, dst, kind, mid):
    """timm's eval view: torchvision's ``Resize(short_side)`` (shorter side to ``short_side``, the longer to
    ``int(short_side * long / short)``), then ``CenterCrop`` to ``dst``'s size (offsets rounded half to even)."""
    if width <= height:
        out_w, out_h = short_side, int(short_side * height / width)
    else:
        out_h, out_w = short_side, int(short_side * width / height)
    row0, col0 = _half_even(out_h - dst.shape[0]), _half_even(out_w - dst.shape[1])
    return resize_window(src, width, 0, 0, height, width, out_h, out_w, row0, col0, dst, kind, mid)


def eval_short_side(img_size: int, crop_ratio: float) -> int:
    """timm's ``scale_size``: the shorter side of the eval resize, floor(img_size / crop_ratio) (256 for 224)."""
    return math.floor(img_size / crop_ratio)
