"""The train and eval transforms (convit_scale/data/transforms.py): shapes, dtypes and the normalised range, random
erasing the only step that leaves it."""

import torch

from convit_scale.config import DataConfig
from convit_scale.data import LoaderSpec, build_loader


def test_transforms_shapes_and_ranges(fm_tree):
    lo, hi = (0 - 0.485) / 0.229 - 1e-4, (1 - 0.406) / 0.225 + 1e-4  # ImageNet-normalised [0, 1] pixels
    for reprob in (0.0, 1.0):
        d = DataConfig(format="imagefolder", train_path=str(fm_tree), val_path=str(fm_tree), num_workers=0,
                       reprob=reprob)
        for split in ("train", "val"):
            x, y = next(iter(build_loader(d, LoaderSpec(split, 32, 8)).epoch(0)))
            assert x.shape == (8, 3, 32, 32) and x.dtype == torch.float32 and y.dtype == torch.long
            assert torch.isfinite(x).all() and ((0 <= y) & (y < 10)).all()
            in_range = bool(((lo <= x) & (x <= hi)).all())
            # random erasing (pixel mode) writes N(0, 1) noise: only then values leave the range
            assert in_range == (split == "val" or reprob == 0.0)
