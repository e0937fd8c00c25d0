"""`bench pixels`: how far each FFCV path's pixels are from timm's, for the same crop boxes, on real photographs.

timm's pixels are the reference (PIL decode; ``F.resized_crop`` bicubic for a RandomResizedCrop box; resize to
256/224 of the size and centre crop for eval), as in the paper's training. Compared, per image and box:

- ``loader``: this project's FFCV decoders (``jpeg.py`` + ``data/resample.py``) on the source JPEG's bytes,
  as ``prep ffcv`` keeps them;
- ``ffcv_own``: ffcv's own decoders on the same bytes (turbojpeg's fast inverse DCT, OpenCV INTER_AREA; eval: the
  centre square of 0.875 of the shorter side, then resized);
- ``ffcv_own_384_q90``: the earlier default end to end: the image shrunk to a 384-pixel side (INTER_AREA) and
  re-encoded at JPEG quality 90 by ffcv's writer, then ffcv's own decoders, the box scaled to the smaller image;
- ``decode_only``: the whole image decoded by ffcv's ``imdecode`` against PIL, no resize;
- ``device_resize`` (train crops): the loader's decode of each box (as above), all of a photograph's boxes resized
  as one batch on ``device`` (``data/device_resize.py`` ``resize_packed``);
- ``device_decode`` (train crops): the JPEG's bytes decoded, cropped and resized as one batch on ``device``
  (``decode_crop_resize``: nvJPEG on CUDA, torchvision's libjpeg-turbo on the CPU).

Numbers: mean absolute difference in pixel levels (0-255) over every channel of every output pixel, its maximum,
and the share of values that differ. Not a timing: it runs in this process.
"""

from __future__ import annotations

import io
import math
from pathlib import Path

import numpy as np
import torch
import torchvision.transforms.functional as F
from PIL import Image
from timm.data import create_transform
from torchvision.transforms import InterpolationMode

from ..data.device_resize import decode_crop_resize, resize_packed
from ..data.resample import FILTERS, eval_short_side, resized_center_crop, resized_crop
from ..ffcv_threads import importing_ffcv
from ..jpeg import decode_rgb

SIZE = 224


def _boxes(height: int, width: int, n: int, rng) -> list[tuple[int, int, int, int]]:
    """RandomResizedCrop boxes (scale 0.08-1, aspect 3/4-4/3; torchvision's rule), from ``rng``."""
    boxes = []
    while len(boxes) < n:
        area = height * width * rng.uniform(0.08, 1.0)
        ratio = math.exp(rng.uniform(math.log(3 / 4), math.log(4 / 3)))
        w, h = int(round(math.sqrt(area * ratio))), int(round(math.sqrt(area / ratio)))
        if 0 < w <= width and 0 < h <= height:
            boxes.append((int(rng.integers(0, height - h + 1)), int(rng.integers(0, width - w + 1)), h, w))
    return boxes


class _Stats:
    def __init__(self):
        self.abs_sum, self.count, self.differ, self.max = 0.0, 0, 0, 0

    def add(self, a: np.ndarray, ref: np.ndarray) -> None:
        d = np.abs(a.astype(np.int16) - ref.astype(np.int16))
        self.abs_sum += float(d.sum())
        self.count += d.size
        self.differ += int(np.count_nonzero(d))
        self.max = max(self.max, int(d.max()))

    def result(self) -> dict:
        return {"mean_abs_diff": self.abs_sum / self.count, "max_abs_diff": self.max,
                "share_differing": self.differ / self.count}


class _FfcvOwn:
    """ffcv's own decode (fast IDCT) and INTER_AREA resize, and its earlier prep (384 side, q90 re-encode)."""

    def __init__(self):
        with importing_ffcv():
            from ffcv.fields.rgb_image import encode_jpeg, get_center_crop, resizer
            from ffcv.libffcv import imdecode, resize_crop
        self.imdecode, self.resize_crop, self.center = imdecode, resize_crop, get_center_crop
        self.encode_jpeg, self.resizer = encode_jpeg, resizer

    def decode(self, data: bytes, h: int, w: int) -> np.ndarray:
        out = np.empty((h, w, 3), np.uint8)
        if self.imdecode(np.frombuffer(data, np.uint8), out, h, w, h, w, 0, 0, 1, 1, False, False) != 0:
            raise ValueError("ffcv's imdecode refused the photograph")
        return out

    def crop(self, pixels: np.ndarray, i: int, j: int, h: int, w: int) -> np.ndarray:
        out = np.empty((SIZE, SIZE, 3), np.uint8)
        self.resize_crop(pixels, i, i + h, j, j + w, out)
        return out

    def eval_view(self, pixels: np.ndarray, ratio: float) -> np.ndarray:
        return self.crop(pixels, *self.center(pixels.shape[0], pixels.shape[1], None, ratio))

    def reencoded(self, rgb: np.ndarray) -> tuple[bytes, tuple[int, int]]:
        small = self.resizer(rgb, 384)
        return self.encode_jpeg(small, 90).tobytes(), small.shape[:2]


def _ours(data: bytes, h: int, w: int):
    src = np.empty(h * w * 3, np.uint8)
    if decode_rgb(np.frombuffer(data, np.uint8), src, h, w) != 0:
        raise ValueError("turbojpeg refused the photograph")
    mid = np.empty(h * SIZE * 3, np.uint8)

    def crop(i, j, ch, cw):
        return resized_crop(src, w, i, j, ch, cw, np.empty((SIZE, SIZE, 3), np.uint8), FILTERS["bicubic"], mid)

    def eval_view(ratio):
        out = np.empty((SIZE, SIZE, 3), np.uint8)
        return resized_center_crop(src, h, w, eval_short_side(SIZE, ratio), out, FILTERS["bicubic"], mid)

    return crop, eval_view


def _on_device(data: bytes, h: int, w: int, boxes: list, device: str) -> tuple[np.ndarray, np.ndarray]:
    """The photograph's train crops for ``boxes`` by the two device modes, (n, S, S, 3) uint8 each."""
    src = np.empty(h * w * 3, np.uint8)
    if decode_rgb(np.frombuffer(data, np.uint8), src, h, w) != 0:
        raise ValueError("turbojpeg refused the photograph")
    src = src.reshape(h, w, 3)
    flat = np.concatenate([src[i:i + ch, j:j + cw].reshape(-1) for i, j, ch, cw in boxes])
    sizes = torch.tensor([(ch, cw) for _, _, ch, cw in boxes])
    resized = resize_packed(torch.from_numpy(flat).to(device), sizes, SIZE)
    encoded = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    decoded = decode_crop_resize([encoded] * len(boxes), torch.tensor(boxes), SIZE, None, device)
    if decoded.refused or decoded.failed:
        raise ValueError(f"the device's decoder refused the photograph: {decoded}")
    return (resized.permute(0, 2, 3, 1).cpu().numpy(), decoded.images.permute(0, 2, 3, 1).cpu().numpy())


def pixel_fidelity(photos: list[Path], boxes: int = 200, seed: int = 0, crop_ratio: float = 0.875,
                   device: str = "cpu") -> dict:
    """The comparison of the module docstring over ``boxes`` crop boxes per photograph and its eval view; the
    device modes run on ``device``."""

    rng, own = np.random.default_rng(seed), _FfcvOwn()
    timm_eval = create_transform(SIZE, is_training=False, interpolation="bicubic", crop_pct=crop_ratio,
                                 use_prefetcher=True)
    train = {k: _Stats() for k in ("loader", "ffcv_own", "ffcv_own_384_q90", "device_resize", "device_decode")}
    evals = {k: _Stats() for k in ("loader", "ffcv_own", "ffcv_own_384_q90")}
    decode = _Stats()
    for path in photos:
        data = Path(path).read_bytes()
        img = Image.open(io.BytesIO(data)).convert("RGB")
        rgb = np.asarray(img)
        h, w = rgb.shape[:2]
        crop, eval_view = _ours(data, h, w)
        fast = own.decode(data, h, w)
        decode.add(fast, rgb)
        small_data, (sh, sw) = own.reencoded(rgb)
        small = own.decode(small_data, sh, sw)
        photo_boxes = _boxes(h, w, boxes, rng)
        resized, decoded = _on_device(data, h, w, photo_boxes, device)
        for k, (i, j, ch, cw) in enumerate(photo_boxes):
            ref = np.asarray(F.resized_crop(img, i, j, ch, cw, [SIZE, SIZE], InterpolationMode.BICUBIC))
            train["device_resize"].add(resized[k], ref)
            train["device_decode"].add(decoded[k], ref)
            train["loader"].add(crop(i, j, ch, cw), ref)
            train["ffcv_own"].add(own.crop(fast, i, j, ch, cw), ref)
            si, sj = round(i * sh / h), round(j * sw / w)  # the same region of the shrunk image
            sch, scw = max(1, min(round(ch * sh / h), sh - si)), max(1, min(round(cw * sw / w), sw - sj))
            train["ffcv_own_384_q90"].add(own.crop(small, si, sj, sch, scw), ref)
        ref = timm_eval(img).permute(1, 2, 0).numpy()
        evals["loader"].add(eval_view(crop_ratio), ref)
        evals["ffcv_own"].add(own.eval_view(fast, crop_ratio), ref)
        evals["ffcv_own_384_q90"].add(own.eval_view(small, crop_ratio), ref)
    return {"photos": [str(p) for p in photos], "boxes_per_photo": boxes, "size": SIZE, "crop_ratio": crop_ratio,
            "device": str(device),
            "train_crop": {k: v.result() for k, v in train.items()},
            "eval_view": {k: v.result() for k, v in evals.items()},
            "decode_only_ffcv_imdecode": decode.result()}
