"""FFCV's compiled stages (convit_scale/data/ffcv_decoders.py): the train crop box drawn from the view's seed under
torchvision's RandomResizedCrop rules, the flip, the label of a view id, the eval normalisation. That the loader's
pixels are timm's for these boxes is tested in test_data_ffcv_fidelity.py."""

from __future__ import annotations

import math

import numpy as np
import torch

from convit_scale.data.ffcv_decoders import FILE_INDEX, ID_BITS, EvalNormalize, _flip_in_place, seeded_crop
from convit_scale.data.transforms import MEAN, STD

SCALE, LOG_RATIO = np.array((0.08, 1.0)), np.log(np.array((3 / 4, 4 / 3)))


def test_the_crop_box_is_a_function_of_the_seed_within_torchvisions_bounds():
    boxes = set()
    for seed in range(200):
        height, width = 97 + seed % 13, 131 - seed % 17
        i, j, h, w = seeded_crop(height, width, SCALE, LOG_RATIO, np.uint64(seed))
        assert (i, j, h, w) == seeded_crop(height, width, SCALE, LOG_RATIO, np.uint64(seed))  # no hidden state
        assert 0 <= i <= height - h and 0 <= j <= width - w and h > 0 and w > 0
        area = h * w / (height * width)  # the rounding of h and w moves area and ratio a little off their ranges
        assert 0.08 * 0.8 <= area <= 1.0 and math.log(3 / 4) - 0.1 <= math.log(w / h) <= math.log(4 / 3) + 0.1
        boxes.add((i, j, h, w))
    assert len(boxes) > 190  # the seed, not the image, chooses the box


def test_an_image_no_box_fits_gets_the_centre_crop_of_the_clamped_ratio():
    """10 attempts fail on a 1000 x 10 strip (no box of ratio in [3/4, 4/3] has 8% of its area): torchvision's
    fallback, the centred crop with the ratio clamped."""
    assert seeded_crop(1000, 10, SCALE, LOG_RATIO, np.uint64(5)) == ((1000 - 13) // 2, 0, 13, 10)
    assert seeded_crop(10, 1000, SCALE, LOG_RATIO, np.uint64(5)) == (0, (1000 - 13) // 2, 10, 13)


def test_flip_reverses_the_columns_in_place():
    img = np.arange(2 * 5 * 3, dtype=np.uint8).reshape(2, 5, 3)
    want = img[:, ::-1].copy()
    _flip_in_place(img)
    assert np.array_equal(img, want)


def test_view_ids_carry_the_file_index_and_eval_normalises_as_timm():
    view = (np.uint64(12345) << ID_BITS) | np.uint64(7)
    assert int(view & FILE_INDEX) == 7 and int(view >> ID_BITS) == 12345
    batch = torch.randint(0, 256, (2, 3, 4, 4), dtype=torch.uint8)
    want = (batch.float() / 255 - torch.tensor(MEAN).view(1, 3, 1, 1)) / torch.tensor(STD).view(1, 3, 1, 1)
    assert torch.allclose(EvalNormalize()(batch), want, atol=1e-5)
