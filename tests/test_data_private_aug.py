"""The FFCV train augmentation with private generators equals timm's after seed_host, and leaves the global RNGs
alone."""

import random

import numpy as np
import pytest
import torch
from PIL import Image
from timm.data import create_transform

from convit_scale.data.private_aug import PrivateAugment
from convit_scale.data.transforms import seed_host


@pytest.mark.parametrize("rand_augment", ["rand-m9-mstd0.5-inc1", None])
def test_private_augment_equals_timm_seeded_globally(rand_augment):
    _, secondary, final = create_transform(input_size=32, is_training=True, hflip=0.0, color_jitter=0.4,
                                           auto_augment=rand_augment, interpolation="bicubic", re_prob=0.5,
                                           re_mode="pixel", re_count=1, separate=True)
    private = PrivateAugment(secondary, final)
    img = Image.fromarray(np.random.default_rng(0).integers(0, 255, (32, 32, 3), dtype=np.uint8))
    outs = []
    for seed in range(12):
        seed_host(seed)
        want = final(secondary(img))
        seed_host(12345)
        state = random.getstate(), np.random.get_state()[1].copy(), torch.get_rng_state()
        got = private(img, seed)
        assert torch.equal(got, want), seed
        assert random.getstate() == state[0] and np.array_equal(np.random.get_state()[1], state[1])
        assert torch.equal(torch.get_rng_state(), state[2])
        outs.append(got)
    assert len({o.sum().item() for o in outs}) > 6  # the seeds do change the augmentation
