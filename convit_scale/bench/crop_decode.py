"""`bench data`'s decode of the train crop: CPU ms per image of the whole decode (then the crop) against the decode
of the crop box alone (``jpeg_roi``), side by side in one process, on the same JPEGs and the same boxes.

Both are the compiled functions the FFCV train decoder calls (``jpeg.decode_rgb`` over the whole image, whose box the
resize then reads in place; ``jpeg.decode_rgb_box``), on one thread, timed with the process's CPU clock in
alternating slices (A B A B ...) so that a shared machine's drift moves both alike. The boxes are timm's
RandomResizedCrop (scale 0.08-1, ratio 3/4-4/3), drawn once per image with a fixed seed. "with_resize" adds what the
decoder does next either way, the box resized to 224 x 224 with PIL's bicubic filter (``resample.resized_crop``).
"webdataset": the WebDataset train path's first step, PIL's whole decode then timm's crop and bicubic resize to 224,
against the header opened and the box alone decoded (``transforms.CropDecodingResizedCrop``), boxes drawn by timm.
"""

from __future__ import annotations

import io
import random
import statistics
import time
from pathlib import Path

import numpy as np
from PIL import Image
from timm.data.transforms import RandomResizedCropAndInterpolation

from .. import jpeg_roi
from ..config import DataConfig
from ..data.faults import open_jpeg_or_decode, pil_rgb
from ..data.resample import FILTERS, resized_crop
from ..data.transforms import build_train_transform
from ..jpeg import decode_rgb, decode_rgb_box

OUT = 224


def _jpegs(tree: str, limit: int = 256) -> list[tuple[np.ndarray, int, int, tuple]]:
    """(bytes, height, width, timm's box (i, j, h, w)) of the tree's first training JPEGs."""
    random.seed(0)
    out = []
    for f in sorted(Path(tree, "train").rglob("*.JPEG"))[:limit]:
        data = f.read_bytes()
        img = Image.open(io.BytesIO(data))  # the header only: timm's box needs the size
        box = RandomResizedCropAndInterpolation.get_params(img, (0.08, 1.0), (3 / 4, 4 / 3))
        out.append((np.frombuffer(data, np.uint8), img.size[1], img.size[0], box))
    return out


def _whole(jpegs, scratch, mid, dst, resize: bool) -> None:
    for data, height, width, (i, j, h, w) in jpegs:
        if decode_rgb(data, scratch, height, width) != 0:
            raise RuntimeError("bench data: turbojpeg refused a JPEG of the bench's tree")
        if resize:
            resized_crop(scratch, width, i, j, h, w, dst, FILTERS["bicubic"], mid)


def _box(jpegs, scratch, mid, dst, resize: bool) -> None:
    for data, height, width, (i, j, h, w) in jpegs:
        if decode_rgb_box(data, scratch, scratch, height, width, i, j, h, w) != 0:
            raise RuntimeError("bench data: the crop-region decoder refused a JPEG of the bench's tree")
        if resize:
            resized_crop(scratch, w, 0, 0, h, w, dst, FILTERS["bicubic"], mid)


def _webdataset(crop, open_image):
    def run(jpegs, scratch, mid, dst, resize: bool) -> None:
        random.seed(1)  # the same boxes for both
        for data, _, _, _ in jpegs:
            crop(open_image(data.tobytes()))
    return run


def crop_decode_costs(tree: str, seconds: float) -> dict:
    """CPU ms per image of the whole decode and of the box's, alone and with the resize, and their ratios (the
    median of the ratios of consecutive slices), after ``seconds`` of slices per candidate and kind."""
    jpegs = _jpegs(tree)
    largest = max(hh * ww for _, hh, ww, _ in jpegs)
    scratch, mid = np.empty(largest * 3, np.uint8), np.empty(max(hh for _, hh, _, _ in jpegs) * OUT * 3, np.uint8)
    dst = np.empty((OUT, OUT, 3), np.uint8)
    before = jpeg_roi.counts()
    out = {}
    crop = build_train_transform(DataConfig(), OUT).transforms[0]  # timm's, taking undecoded JPEGs too
    kinds = {"decode": (_whole, _box, False), "with_resize": (_whole, _box, True),
             "webdataset": (_webdataset(crop, pil_rgb), _webdataset(crop, open_jpeg_or_decode), True)}
    for kind, (whole, box, resize) in kinds.items():
        for run in (whole, box):  # compile, warm the caches
            run(jpegs[:8], scratch, mid, dst, resize)
        spent, ratios = {"whole": 0.0, "box": 0.0}, []
        while min(spent.values()) < seconds:
            times = {}
            for name, run in (("whole", whole), ("box", box)):
                t0 = time.process_time()
                run(jpegs, scratch, mid, dst, resize)
                times[name] = time.process_time() - t0
                spent[name] += times[name]
            ratios.append(times["whole"] / times["box"])
        images = len(jpegs) * len(ratios)
        out[kind] = {"whole_cpu_ms_per_image": 1000 * spent["whole"] / images,
                     "box_cpu_ms_per_image": 1000 * spent["box"] / images,
                     "whole_vs_box": statistics.median(ratios), "slices": len(ratios)}
    after = jpeg_roi.counts()
    sizes = sorted({(hh, ww) for _, hh, ww, _ in jpegs})
    kept = statistics.mean(b[2] * b[3] / (hh * ww) for _, hh, ww, b in jpegs)
    return {**out, "images": len(jpegs), "sizes": [list(s) for s in sizes[:3]], "mean_box_fraction": kept,
            "box_decodes": after["decoded"] - before["decoded"], "box_refused": after["refused"] - before["refused"],
            "library": after["library"]}
