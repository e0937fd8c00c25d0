"""timm's RandAugment strings parsed without timm (convit_scale/augment_policy.py), against timm's own parser, and
what the device augmentation cannot run named before any process starts."""

from __future__ import annotations

import pytest
from timm.data.auto_augment import rand_augment_transform

from convit_scale.augment_policy import LEVEL_DENOM, RandAugmentPolicy, unsupported_on_device
from convit_scale.config import DataConfig


@pytest.mark.parametrize("text", ["rand-m9-mstd0.5-inc1", "rand-m7-n3-p0.8-mstd101-mmax12", "rand-m5-mmax0",
                                  "rand", "rand-n1-inc0", "rand-m10-mstd1.5"])
def test_each_section_is_read_as_timm_reads_it(text):
    ours, timms = RandAugmentPolicy.parse(text), rand_augment_transform(text, {})
    op = timms.ops[0]
    assert list(ours.ops) == [o.name for o in timms.ops]
    assert (ours.num_layers, ours.magnitude, ours.prob, ours.magnitude_std) == (
        timms.num_layers, op.magnitude, op.prob, op.magnitude_std)
    assert ours.magnitude_max == (op.magnitude_max or LEVEL_DENOM)  # timm clips to `magnitude_max or 10`


def test_what_the_device_cannot_run_is_named_with_the_way_out():
    assert unsupported_on_device(DataConfig()) is None  # DeiT's recipe: rand-m9-mstd0.5-inc1, bicubic
    why = unsupported_on_device(DataConfig(rand_augment="rand-m9-w0"))
    assert why.startswith("data.rand_augment = 'rand-m9-w0' does not run on the device") and "augment_on=cpu" in why
    assert "bicubic" in unsupported_on_device(DataConfig(interpolation="bilinear"))
    assert "color_jitter = 0.4" in unsupported_on_device(DataConfig(rand_augment=None, color_jitter=0.4))
    assert unsupported_on_device(DataConfig(rand_augment=None, color_jitter=0.0)) is None
