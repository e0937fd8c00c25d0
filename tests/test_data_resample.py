"""The FFCV loader's resize is PIL's, bit for bit: timm's RandomResizedCrop for a crop box, timm's eval view."""

import numpy as np
import pytest
import torchvision.transforms.functional as F
from PIL import Image
from test_jpeg import photo_like
from timm.data import create_transform
from torchvision.transforms import InterpolationMode

from convit_scale.data.resample import FILTERS, eval_short_side, resized_center_crop, resized_crop

MODES = {"bicubic": InterpolationMode.BICUBIC, "bilinear": InterpolationMode.BILINEAR}


@pytest.mark.parametrize("interpolation", MODES)
def test_crop_boxes_resize_as_timms_random_resized_crop(interpolation):
    rng = np.random.default_rng(0)
    pixels = photo_like(181, 243)
    img, flat, mid = Image.fromarray(pixels), pixels.reshape(-1), np.empty(181 * 224 * 3, np.uint8)
    boxes = [(0, 0, 181, 243), (10, 20, 150, 194), (5, 7, 13, 17), (0, 19, 181, 224), (3, 0, 1, 1)]
    for _ in range(40):  # RandomResizedCrop's range of boxes: scale 0.08-1 of the area, aspect 3/4-4/3, any place
        h, w = int(rng.integers(8, 182)), int(rng.integers(8, 244))
        boxes.append((int(rng.integers(0, 182 - h)), int(rng.integers(0, 244 - w)), h, w))
    for size in (224, 32):
        for i, j, h, w in boxes:
            out = np.empty((size, size, 3), np.uint8)
            resized_crop(flat, 243, i, j, h, w, out, FILTERS[interpolation], mid)
            ref = np.asarray(F.resized_crop(img, i, j, h, w, [size, size], MODES[interpolation]))
            assert np.array_equal(out, ref), (size, i, j, h, w, np.abs(out.astype(int) - ref).max())


@pytest.mark.parametrize("interpolation", MODES)
def test_eval_view_is_timms_resize_then_centre_crop(interpolation):
    """Shorter side to floor(size / ratio), the longer in proportion, centre crop with torchvision's rounding of
    half pixels to even: landscape, portrait, odd margins, an image already at the short side, upsampling."""
    mid = np.empty(400 * 224 * 3, np.uint8)
    for size, ratio in ((224, 0.875), (224, 1.0), (32, 0.875), (160, 0.9)):
        tf = create_transform(size, is_training=False, interpolation=interpolation, crop_pct=ratio,
                              use_prefetcher=True)
        short = eval_short_side(size, ratio)
        for h, w in ((301, 400), (400, 301), (257, 387), (short, short + 3), (short + 1, short), (28, 28)):
            pixels = photo_like(h, w, seed=h + w)
            out = np.empty((size, size, 3), np.uint8)
            resized_center_crop(pixels.reshape(-1), h, w, short, out, FILTERS[interpolation], mid)
            ref = tf(Image.fromarray(pixels)).permute(1, 2, 0).numpy()
            assert np.array_equal(out, ref), (size, ratio, h, w, np.abs(out.astype(int) - ref).max())
