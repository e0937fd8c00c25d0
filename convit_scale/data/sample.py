"""The sample contract: what every loader (``imagefolder.py``, ``wds.py``, ``ffcv.py``), in every hand-over mode
(``LoaderSpec.handover``), does with a training view, said once so that the formats and modes cannot drift apart.

- Which views a rank reads in an epoch, at which canonical positions, with which padding, and from where a resume
  continues (``start_batch``): ``geometry.py`` (``EpochGeometry``, ``LoaderSpec``) over ``order.py``'s permutation.
- A view's seed, a function of (run seed, epoch, canonical position) only: ``view_seeds`` (``order.py``).
- Its RandomResizedCrop box and its horizontal flip, drawn from the seed alone (splitmix64, ``splitmix_numba.py``):
  ``crop_box`` and ``flipped``, compiled (and cached on disk), so the FFCV decoders call them inside their numba
  stages and the other loaders from Python: a view gets the same box and flip in every format and mode, and the same
  box whatever consumed the host generators before it.
- What its augmentation after the crop draws from: the host generators seeded by the view's seed (``seed_host``):
  timm's transform in ImageFolder and WebDataset; in FFCV, ``private_aug.py``'s private generators that draw
  alike; on the device, counter-based draws of the seed (``device_augment.py``).
- A view whose image cannot be read or decoded takes the next view that can (``faults.next_good``) of its canonical
  group (FFCV, ImageFolder and the device's decoder: within the group in the batch; WebDataset: the group's
  partition stream, looking ahead past the step), cropped and flipped with its own seed (the device's decoder: the
  replacement's crop), and is listed in ``Batch.bad``.
"""

from __future__ import annotations

import numpy as np

from ..splitmix_numba import flipped, seeded_crop
from .faults import next_good
from .order import view_seeds

__all__ = ["compile_draws", "crop_box", "flipped", "next_good", "seeded_crop", "view_seeds"]


def crop_box(height: int, width: int, seed: int, scale=(0.08, 1.0), ratio=(3 / 4, 4 / 3)) -> tuple:
    """``seeded_crop`` from Python: the (i, j, h, w) box of a ``height`` x ``width`` image for the view ``seed``."""
    return seeded_crop(np.uint32(height), np.uint32(width), np.array(scale, dtype=np.float64),
                       np.log(np.array(ratio, dtype=np.float64)), np.uint64(seed))


def compile_draws() -> None:
    """Compile ``seeded_crop`` and ``flipped`` now: when the train transform is built, before the run measures its
    base memory and before DataLoader workers are forked (they inherit the compiled code rather than each compiling
    it on its first view). The compiled code is cached on disk (``splitmix_numba.py``): after the first process on
    a machine, this loads it."""
    crop_box(2, 2, 0)
    flipped(np.uint64(0), 0.5)
