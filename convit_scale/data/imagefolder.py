"""ImageFolder (the baseline): a torch DataLoader over the epoch plan, each sample's transform seeded."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
from PIL import Image
from torch.utils.data import DataLoader, Dataset

from convit_scale.imagetree import is_val_only, scan_class_folders, scan_split, subsample, tree_classes

from ..config import DataConfig
from .batch import Batch, stack_views
from .faults import DECODE_ERRORS, DataError, limit_bad_samples, next_good, reason_of
from .geometry import EpochGeometry, LoaderSpec
from .order import view_seeds
from .transforms import build_eval_transform, build_train_transform, transform_view
from .workers import iterate, loader_options


class _SeededImages(Dataset):
    """Items are (index, seed): the transform is seeded per sample, so order and resume don't matter."""

    def __init__(self, samples: list[tuple[str, int]], transform, train: bool = False, img_size: int = 224):
        self.samples, self.transform, self.train, self.img_size = samples, transform, train, img_size

    def __len__(self) -> int:
        return len(self.samples)

    def open(self, j: int):
        """(image, label) of sample ``j``, or the bad-sample record of a file that cannot be read or decoded."""
        path, label = self.samples[j % len(self.samples)]
        try:
            return Image.open(path).convert("RGB"), label
        except DECODE_ERRORS as e:
            return {"file": path, "key": Path(path).stem, "reason": f"unreadable image ({reason_of(e)})"}

    def __getitem__(self, item):
        """(image, label, bad, index). In training a file that cannot be read or decoded gives (None, seed, [its
        record], index): the batch replaces it within its canonical group (``_Collate``). In evaluation it is not
        replaced by another image (which would be scored in its place) but marked with label -1, which evaluation
        does not score, and listed in ``bad``."""
        index, seed = item
        opened = self.open(index)
        if isinstance(opened, dict):
            if self.train:
                return None, seed, [opened], index
            blank = transform_view(self.transform, Image.new("RGB", (self.img_size, self.img_size)), seed)
            return blank, -1, [{**opened, "scored": False}], index  # the batch's shape and dtype
        img, label = opened
        return transform_view(self.transform, img, seed), label, [], index


class _Collate:
    """A batch of ``_SeededImages`` items. A training view whose file could not be read takes the next view of its
    canonical group (``group`` views; the sample contract, sample.py) that could, re-read and augmented with the
    failed view's own seed, and its label."""

    def __init__(self, dataset: _SeededImages, group: int):
        self.dataset, self.group = dataset, group

    def __call__(self, items) -> Batch:
        items = list(items)
        failed = {i for i, item in enumerate(items) if item[0] is None}
        for i in sorted(failed):
            base = i - i % self.group
            j = next_good({f - base for f in failed if base <= f < base + self.group}, i - base, self.group)
            if j is None:
                raise DataError(f"{items[i][2][0]['file']}: no readable image in its canonical group of "
                                f"{self.group} views; convert with `convit-scale prep` to skip such files")
            img, label = self.dataset.open(items[base + j][3])
            items[i] = (transform_view(self.dataset.transform, img, items[i][1]), label, items[i][2], items[i][3])
        images = stack_views([item[0] for item in items])
        labels = torch.tensor([item[1] for item in items], dtype=torch.long)
        return Batch(images, labels, bad=[record for item in items for record in item[2]])


def imagefolder_samples(root: Path, split: str, fraction: float,
                        num_classes: int | None = None) -> list[tuple[str, int]]:
    """(path, label) of a split (train: its Table 2 subset), in the first ``num_classes`` classes (None: all)."""
    classes = tree_classes(root)
    val_only = split == "val" and is_val_only(root)  # `eval --data /data/imagenet/val`: the split is the root
    samples, _ = scan_class_folders(root, classes) if val_only else scan_split(root, split, classes)
    if num_classes is not None:
        samples = [s for s in samples if s.label < num_classes]
    if split == "train":
        samples = subsample(samples, fraction)
    return [(s.path, s.label) for s in samples]


class ImageFolderLoader:
    """ImageFolder through a torch DataLoader and the epoch plan of ``plan.py``."""

    def __init__(self, d: DataConfig, spec: LoaderSpec):
        root = Path(d.train_path if spec.train else d.val_path)
        if not (root / spec.split).is_dir() and not (spec.split == "val" and is_val_only(root)):
            raise DataError(f"data.{'train' if spec.train else 'val'}_path: no {spec.split} folder in {root}")
        self.samples = imagefolder_samples(root, spec.split, d.subset_fraction, d.num_classes)
        self.d, self.spec = d, spec
        self.num_samples = len(self.samples)
        on_device = spec.augment_on_device
        transform = (build_train_transform(d, spec.img_size, on_device, spec.handover) if spec.train
                     else build_eval_transform(d, spec.img_size, on_device))
        self.dataset = _SeededImages(self.samples, transform, spec.train, spec.img_size)
        self.geometry = EpochGeometry.of(self.num_samples, spec, str(root))
        self.num_real = self.geometry.num_real

    def __len__(self) -> int:
        return self.geometry.num_batches

    def epoch(self, epoch: int, start_batch: int = 0):
        s, b = self.spec, self.spec.micro_batch_size
        idx, positions = self.geometry.sample_indices(epoch, self.d.repeated_aug, start_batch)
        # Seeded by the view's position in the epoch: the same sample gets the same augmentation whatever the world
        # size, so runs on 1 and on N ranks see identical global batches.
        seeds = view_seeds(s.seed, epoch, positions)
        items = list(zip(idx.tolist(), seeds.tolist()))
        loader = DataLoader(self.dataset, batch_size=b, sampler=items, drop_last=s.train, persistent_workers=False,
                            collate_fn=_Collate(self.dataset, s.group_size if s.train else b), pin_memory=s.pin_memory,
                            **loader_options(self.d.num_workers, s.seed, epoch))
        batches = limit_bad_samples(iterate(loader), self.d.max_bad_samples, epoch, s.rank)
        if not s.train:
            yield from batches
            return
        seeds, ids = torch.from_numpy(seeds.astype(np.int64)), idx.tolist()
        for k, batch in enumerate(batches):  # in order: batch k holds items [k*b, (k+1)*b)
            # the sample seeds feed the device augmentation and the per-sample drop-path; the ids, log.debug_samples
            batch.seeds, batch.ids = seeds[k * b: k * b + len(batch.labels)], ids[k * b: k * b + len(batch.labels)]
            yield batch
