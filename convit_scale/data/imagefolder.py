"""ImageFolder (the baseline): a torch DataLoader over the epoch plan, each sample's transform seeded."""

from __future__ import annotations

from pathlib import Path

import torch
from PIL import Image
from torch.utils.data import DataLoader, Dataset, default_collate

from ..config import DataConfig
from .batch import Batch
from .geometry import DataError, EpochGeometry, LoaderSpec
from .plan import sample_seed
from .transforms import build_eval_transform, build_train_transform, seed_all
from .workers import private_generator, worker_init_fn


class _SeededImages(Dataset):
    """Items are (index, seed): the transform is seeded per sample, so order and resume don't matter."""

    def __init__(self, samples: list[tuple[str, int]], transform):
        self.samples, self.transform = samples, transform

    def __len__(self) -> int:
        return len(self.samples)

    def __getitem__(self, item):
        index, seed = item
        path, label = self.samples[index]
        seed_all(seed)
        try:
            img = Image.open(path).convert("RGB")
        except OSError as e:
            raise DataError(f"{path}: unreadable image ({e}); convert with `convit-scale prep` to skip such files") from e
        return self.transform(img), label


def _collate(items) -> Batch:
    images, labels = default_collate(items)
    return Batch(images, labels)


def imagefolder_samples(root: Path, split: str, fraction: float) -> list[tuple[str, int]]:
    from data_prep.scan import list_classes, scan_split, subsample

    classes = list_classes(root / "train")
    samples, _ = scan_split(root, split, classes)
    if split == "train":
        samples = subsample(samples, fraction)
    return [(s.path, s.label) for s in samples]


class MapStyleLoader:
    """ImageFolder through a torch DataLoader and the epoch plan of ``plan.py``."""

    def __init__(self, d: DataConfig, spec: LoaderSpec):
        root = Path(d.train_path if spec.train else d.val_path)
        if not (root / spec.split).is_dir():
            raise DataError(f"data.{'train' if spec.train else 'val'}_path: no {spec.split} folder in {root}")
        self.samples = imagefolder_samples(root, spec.split, d.subset_fraction)
        self.d, self.spec = d, spec
        self.num_samples = len(self.samples)
        on_device = spec.augment_on_device
        transform = (build_train_transform(d, spec.img_size, on_device) if spec.train
                     else build_eval_transform(d, spec.img_size, on_device))
        self.dataset = _SeededImages(self.samples, transform)
        self.geometry = EpochGeometry.of(self.num_samples, spec, str(root))
        self.num_real = self.geometry.num_real

    def __len__(self) -> int:
        return self.geometry.num_batches

    def epoch(self, epoch: int, start_batch: int = 0):
        s, b = self.spec, self.spec.micro_batch_size
        idx = self.geometry.sample_indices(epoch, self.d.repeated_aug)[start_batch * b:]
        # Seeded by the view's global position: the same sample gets the same augmentation whatever
        # the world size, so runs on 1 and on N ranks see identical batches.
        positions = self.geometry.global_positions(start_batch * b, len(idx))
        items = [(int(i), sample_seed(s.seed, epoch, 0, int(p))) for i, p in zip(idx, positions)]
        loader = DataLoader(self.dataset, batch_size=b, sampler=items, drop_last=s.train,
                            num_workers=self.d.num_workers, persistent_workers=False,
                            generator=private_generator(s.seed, epoch), worker_init_fn=worker_init_fn(),
                            collate_fn=_collate, pin_memory=s.pin_memory)
        if not (s.train and s.augment_on_device):
            yield from loader
            return
        seeds = torch.tensor([seed for _, seed in items], dtype=torch.int64)
        for k, batch in enumerate(loader):  # in order: batch k holds items [k*b, (k+1)*b)
            batch.seeds = seeds[k * b: k * b + len(batch.labels)]
            yield batch
