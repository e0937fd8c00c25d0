"""Loaders with one contract: ``loader.epoch(epoch, start_batch)`` yields ``(images, labels)`` batches.

- images: float (B, 3, S, S), normalised; labels: int64 (B,).
- ``len(loader)`` batches per epoch, the same on every rank.
- train: shuffled per epoch from the seed, repeated augmentation, last partial batch dropped;
  eval: sequential, rank r holds the contiguous positions [r*V, (r+1)*V) with V = ceil(N / world),
  positions past N repeat earlier samples and only the first ``num_real`` samples of a rank count.
- augmentation is seeded per sample or batch, so a resumed epoch continues bit-identically.

Formats: ImageFolder (the baseline), WebDataset shards from ``data_prep`` (local paths or any URL
webdataset opens: ``pipe:`` commands, http), and FFCV .beton files.
"""

from __future__ import annotations

import io
import json
import math
import tarfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from PIL import Image
from torch.utils.data import DataLoader, Dataset, IterableDataset, get_worker_info

from ..config import DataConfig
from .plan import contiguous_range, epoch_permutation, rank_indices, sample_seed, views_per_rank
from .transforms import build_eval_transform, build_train_transform, seed_all


class DataError(RuntimeError):
    """Unusable data (missing files, a truncated shard, a manifest mismatch): one line naming the input."""


@dataclass
class LoaderSpec:
    """Everything a loader needs besides the data section."""

    split: str  # "train" or "val"
    img_size: int
    micro_batch_size: int
    world_size: int = 1
    rank: int = 0
    seed: int = 0

    @property
    def train(self) -> bool:
        return self.split == "train"


def eval_positions(num_samples: int, spec: LoaderSpec) -> tuple[np.ndarray, int]:
    """Contiguous eval positions of this rank (wrapped past N) and how many of them are real."""
    v = views_per_rank(num_samples, spec.world_size)
    start = spec.rank * v
    return np.arange(start, start + v) % num_samples, max(0, min(v, num_samples - start))


def _private_generator(seed: int, epoch: int) -> torch.Generator:
    """DataLoader draws worker seeds from a generator: keep it off the global RNG, so creating an
    iterator in the middle of an epoch (a resume) leaves the training step's random numbers alone."""
    return torch.Generator().manual_seed(seed * 1000003 + epoch)


def _decode(data: bytes) -> Image.Image:
    return Image.open(io.BytesIO(data)).convert("RGB")


# -- ImageFolder -----------------------------------------------------------------------------------
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
        transform = build_train_transform(d, spec.img_size) if spec.train else build_eval_transform(d, spec.img_size)
        self.dataset = _SeededImages(self.samples, transform)
        v = views_per_rank(self.num_samples, spec.world_size)
        self.num_real = v if spec.train else eval_positions(self.num_samples, spec)[1]
        self._len = v // spec.micro_batch_size if spec.train else math.ceil(v / spec.micro_batch_size)
        if self._len == 0:
            raise DataError(f"{root}: {self.num_samples} {spec.split} samples give no batch of "
                            f"{spec.micro_batch_size} on each of {spec.world_size} ranks")

    def __len__(self) -> int:
        return self._len

    def epoch(self, epoch: int, start_batch: int = 0):
        s, b = self.spec, self.spec.micro_batch_size
        if s.train:
            idx = rank_indices(self.num_samples, s.world_size, s.rank, s.seed, epoch, self.d.repeated_aug)
        else:
            idx = eval_positions(self.num_samples, s)[0]
        idx = idx[: self._len * b][start_batch * b:]
        base = start_batch * b
        # Seeded by the view's global position (rank + k * world): the same sample gets the same
        # augmentation whatever the world size, so runs on 1 and on N ranks see identical batches.
        items = [(int(i), sample_seed(s.seed, epoch, 0, s.rank + (base + k) * s.world_size))
                 for k, i in enumerate(idx)]
        loader = DataLoader(self.dataset, batch_size=b, sampler=items, drop_last=s.train,
                            num_workers=self.d.num_workers, persistent_workers=False,
                            generator=_private_generator(s.seed, epoch))
        yield from loader


# -- WebDataset ------------------------------------------------------------------------------------
def _open(location: str, name: str):
    """Open a file next to ``location``: a local folder, or a URL template with ``{name}``
    (``pipe:aws s3 cp s3://bucket/imagenet/{name} -``, ``https://host/shards/{name}``)."""
    from webdataset.gopen import gopen

    if "{name}" in location:
        return gopen(location.format(name=name), "rb")
    path = Path(location) / name
    if not path.is_file():
        raise DataError(f"{path}: not found")
    return open(path, "rb")


def read_manifest(location: str) -> dict:
    try:
        with _open(location, "manifest.json") as f:
            return json.loads(f.read())
    except (OSError, ValueError) as e:
        raise DataError(f"{location}: no readable manifest.json ({e}); convert with `convit-scale prep`") from e


def _iter_tar(location: str, name: str):
    """(key, jpeg bytes, label) of one shard, in order; a truncated shard raises DataError."""
    key, jpg, cls = None, None, None
    try:
        with _open(location, name) as stream, tarfile.open(fileobj=stream, mode="r|") as tar:
            for member in tar:
                stem, ext = member.name.rsplit(".", 1)
                payload = tar.extractfile(member).read()
                if len(payload) != member.size:
                    raise tarfile.ReadError(f"member {member.name} truncated")
                if stem != key:
                    key, jpg, cls = stem, None, None
                if ext == "jpg":
                    jpg = payload
                elif ext == "cls":
                    cls = int(payload)
                if jpg is not None and cls is not None:
                    yield int(key), jpg, cls
                    key, jpg, cls = None, None, None
    except (tarfile.TarError, EOFError, ValueError) as e:
        raise DataError(f"{location}/{name}: truncated or corrupt shard ({type(e).__name__}: {e}); "
                        f"run `convit-scale prep verify` and re-convert") from e


class _WdsEpoch(IterableDataset):
    """One rank's epoch as whole batches, split over DataLoader workers in contiguous batch ranges.

    The epoch's sample sequence is the shards in a per-epoch permuted order; the rank reads the
    contiguous range of it that it owns (at most two shards partially), each worker a contiguous piece
    of that, streamed through a seeded shuffle buffer. The DataLoader interleaves workers round-robin, so
    the k-th batch of the epoch is the (k // W)-th batch of the worker in role k % W. After a resume at
    batch k0, DataLoader worker i takes role (i + k0) % W, which keeps that order exactly.
    """

    def __init__(self, loader: "WdsLoader", epoch: int, start_batch: int):
        self.loader, self.epoch, self.start_batch = loader, epoch, start_batch

    def _views(self, first_batch: int, last_batch: int) -> list[int]:
        """Sequence positions of the views in batches [first_batch, last_batch) of this rank's range."""
        ld, s, b = self.loader, self.loader.spec, self.loader.spec.micro_batch_size
        n = ld.num_samples
        if not s.train:
            return [int(p) for p in eval_positions(n, s)[0][first_batch * b: last_batch * b]]
        r = ld.d.repeated_aug
        start = s.rank * math.ceil(ld.views_per_rank / r)
        return [(start + v // r) % n for v in range(first_batch * b, last_batch * b)]

    def _read(self, views: list[int]):
        """Stream (jpeg, label) for each view position, in order, reading each needed shard once."""
        ld = self.loader
        shards = ld.shard_order(self.epoch)
        offsets = np.cumsum([0] + [c for _, c in shards])
        segments, seg = [], []
        for p in views:  # split where the positions wrap around the end of the sequence
            if seg and p < seg[-1]:
                segments.append(seg)
                seg = []
            seg.append(p)
        if seg:
            segments.append(seg)
        for seg in segments:
            counts: dict[int, int] = {}
            for p in seg:
                counts[p] = counts.get(p, 0) + 1
            lo_pos, hi_pos = seg[0], seg[-1]
            for si, (name, count) in enumerate(shards):
                lo = int(offsets[si])
                if lo + count <= lo_pos or lo > hi_pos:
                    continue
                for off, (_, jpg, label) in enumerate(_iter_tar(ld.location, name)):
                    for _ in range(counts.get(lo + off, 0)):
                        yield jpg, label
                    if lo + off >= hi_pos:
                        break

    def __iter__(self):
        ld, s, b = self.loader, self.loader.spec, self.loader.spec.micro_batch_size
        info = get_worker_info()
        worker, nw = (info.id, info.num_workers) if info else (0, 1)
        role = (worker + self.start_batch) % nw
        first, last = contiguous_range(len(ld), nw, role)
        stream = self._read(self._views(first, last))
        if s.train:  # seeded per epoch, rank and role: the same order after a resume
            stream = _shuffle_buffer(stream, ld.buffer_size, np.random.default_rng([s.seed, self.epoch, s.rank, role]))
        skip = max(0, (self.start_batch - role + nw - 1) // nw)  # batches of this role already consumed
        for j in range(last - first):
            chunk = [next(stream) for _ in range(b)] if j < last - first - 1 or s.train else list(stream)
            if j < skip:
                continue  # skipped without decoding
            k = role + j * nw  # position of this batch in the epoch
            images = []
            for i, (jpg, _) in enumerate(chunk):
                seed_all(sample_seed(s.seed, self.epoch, s.rank, k * b + i))
                images.append(ld.transform(_decode(jpg)))
            yield torch.stack(images), torch.tensor([label for _, label in chunk], dtype=torch.long)


def _shuffle_buffer(items, size: int, rng: np.random.Generator):
    """webdataset's shuffle: fill a buffer, emit a random element, refill (bounded memory)."""
    buf = []
    for item in items:
        buf.append(item)
        if len(buf) >= size:
            k = int(rng.integers(len(buf)))
            buf[k], buf[-1] = buf[-1], buf[k]
            yield buf.pop()
    while buf:
        k = int(rng.integers(len(buf)))
        buf[k], buf[-1] = buf[-1], buf[k]
        yield buf.pop()


class WdsLoader:
    def __init__(self, d: DataConfig, spec: LoaderSpec, buffer_size: int = 2000):
        self.location = d.train_path if spec.train else d.val_path
        manifest = read_manifest(self.location)
        if spec.split not in manifest.get("splits", {}):
            raise DataError(f"{self.location}: manifest has no {spec.split!r} split")
        prepared_f = manifest["options"].get("subset_fraction", 1.0)
        if spec.train and not math.isclose(prepared_f, d.subset_fraction):
            raise DataError(f"{self.location}: shards hold subset_fraction={prepared_f}, the recipe asks "
                            f"{d.subset_fraction}; convert with `convit-scale prep wds --subset-fraction "
                            f"{d.subset_fraction}` (WebDataset subsets are made at conversion)")
        files = manifest["splits"][spec.split]["files"]
        self.shards = [(name, rec["samples"]) for name, rec in sorted(files.items())]
        self.num_samples = sum(c for _, c in self.shards)
        self.d, self.spec, self.buffer_size = d, spec, buffer_size
        self.transform = build_train_transform(d, spec.img_size) if spec.train else build_eval_transform(d, spec.img_size)
        self.views_per_rank = views_per_rank(self.num_samples, spec.world_size)
        self.num_real = self.views_per_rank if spec.train else eval_positions(self.num_samples, spec)[1]
        b = spec.micro_batch_size
        self._len = self.views_per_rank // b if spec.train else math.ceil(self.views_per_rank / b)
        if self._len == 0:
            raise DataError(f"{self.location}: {self.num_samples} samples give no batch of {b} per rank")

    def __len__(self) -> int:
        return self._len

    def shard_order(self, epoch: int) -> list[tuple[str, int]]:
        if not self.spec.train:
            return self.shards
        return [self.shards[i] for i in epoch_permutation(len(self.shards), self.spec.seed, epoch)]

    def epoch(self, epoch: int, start_batch: int = 0):
        workers = min(self.d.num_workers, self._len)
        loader = DataLoader(_WdsEpoch(self, epoch, start_batch), batch_size=None, num_workers=workers,
                            generator=_private_generator(self.spec.seed, epoch))
        yield from loader


# -- FFCV -----------------------------------------------------------------------------------------
class _TimmAfterFfcv(torch.nn.Module):
    """Per-image timm RandAugment + normalise + random erasing after FFCV's crop/flip (uint8 batch in)."""

    def __init__(self, secondary, final, seed_fn):
        super().__init__()
        self.secondary, self.final, self.seed_fn = secondary, final, seed_fn
        self.calls = 0

    def forward(self, batch: torch.Tensor) -> torch.Tensor:  # (B, 3, S, S) uint8
        seed_all(self.seed_fn(self.calls))
        self.calls += 1
        out = []
        for img in batch:
            pil = Image.fromarray(img.permute(1, 2, 0).numpy())
            out.append(self.final(self.secondary(pil)))
        return torch.stack(out)


class FfcvLoader:
    """FFCV .beton through ffcv's Loader with the epoch plan as its traversal order.

    Differences from timm, by FFCV's design: the crop is decoded and resized in one step with OpenCV's
    INTER_AREA (not bicubic), and eval crops the centre square (ratio 0.875) before resizing rather than
    resizing to 256 first (same geometry). RandAugment, normalisation and random erasing are timm's.
    """

    def __init__(self, d: DataConfig, spec: LoaderSpec):
        from ffcv.fields.basics import IntDecoder
        from ffcv.fields.rgb_image import CenterCropRGBImageDecoder, RandomResizedCropRGBImageDecoder
        from ffcv.loader import Loader
        from ffcv.loader.loader import ORDER_MAP
        from ffcv.transforms import RandomHorizontalFlip, Squeeze, ToTensor, ToTorchImage
        from ffcv.traversal_order.base import TraversalOrder

        location = Path(d.train_path if spec.train else d.val_path)
        manifest = read_manifest(str(location))
        if spec.split not in manifest.get("splits", {}):
            raise DataError(f"{location}: manifest has no {spec.split!r} split")
        info = manifest["splits"][spec.split]
        (name,) = info["files"]
        # Files are written in sorted (class, file) order: Table 2 subsets are index ranges per class.
        counts = [info["per_class"].get(str(c), 0) for c in range(len(manifest["classes"]))]
        starts = np.cumsum([0] + counts)
        f = d.subset_fraction if spec.train else 1.0
        indices = np.concatenate([np.arange(s, s + math.floor(c * f)) for s, c in zip(starts, counts)])
        self.num_samples = len(indices)
        self.d, self.spec = d, spec
        b = spec.micro_batch_size
        v = views_per_rank(self.num_samples, spec.world_size)
        self.num_real = v if spec.train else eval_positions(self.num_samples, spec)[1]
        self._len = v // b if spec.train else math.ceil(v / b)
        if self._len == 0:
            raise DataError(f"{location}: {self.num_samples} samples give no batch of {b} per rank")
        self._epoch, self._start = 0, 0
        outer = self

        class PlanOrder(TraversalOrder):
            def sample_order(self, epoch):  # positions into `indices`, then ffcv maps them
                s = outer.spec
                if s.train:
                    pos = rank_indices(outer.num_samples, s.world_size, s.rank, s.seed, outer._epoch,
                                       outer.d.repeated_aug)
                else:
                    pos = eval_positions(outer.num_samples, s)[0]
                pos = pos[: outer._len * b][outer._start * b:]
                return self.indices[pos]

        key = f"convit_scale_plan_{id(self)}"
        ORDER_MAP[key] = PlanOrder
        size = spec.img_size
        if spec.train:
            from timm.data import create_transform

            _, secondary, final = create_transform(
                input_size=size, is_training=True, hflip=0.0, color_jitter=d.color_jitter,
                auto_augment=d.rand_augment, interpolation=d.interpolation, re_prob=d.reprob,
                re_mode="pixel", re_count=1, separate=True)
            image_pipe = [RandomResizedCropRGBImageDecoder((size, size), scale=(0.08, 1.0)),
                          RandomHorizontalFlip(d.hflip), ToTensor(), ToTorchImage(channels_last=False),
                          _TimmAfterFfcv(secondary, final, lambda k: sample_seed(outer.spec.seed, outer._epoch,
                                                                                 outer.spec.rank, outer._start + k))]
        else:
            image_pipe = [CenterCropRGBImageDecoder((size, size), ratio=d.eval_crop_ratio), ToTensor(),
                          ToTorchImage(channels_last=False), _EvalNormalize()]
        self._make = lambda: Loader(
            str(location / name), batch_size=b, num_workers=max(1, d.num_workers), order=key,
            indices=indices, seed=spec.seed, drop_last=spec.train, os_cache=True,
            pipelines={"image": image_pipe, "label": [IntDecoder(), ToTensor(), Squeeze()]},
        )
        self._image_pipe = image_pipe
        self._loader = None  # built once: each ffcv Loader compiles its pipeline with numba (seconds)

    def __len__(self) -> int:
        return self._len

    def epoch(self, epoch: int, start_batch: int = 0):
        self._epoch, self._start = epoch, start_batch
        if isinstance(self._image_pipe[-1], _TimmAfterFfcv):
            self._image_pipe[-1].calls = 0
        if self._loader is None:
            self._loader = self._make()
        for images, labels in self._loader:
            # ffcv reuses its output buffers: copy what leaves the loader.
            yield images.clone(), labels.clone().long()


class _EvalNormalize(torch.nn.Module):
    def forward(self, batch: torch.Tensor) -> torch.Tensor:
        from .transforms import MEAN, STD

        mean = torch.tensor(MEAN).view(1, 3, 1, 1) * 255
        std = torch.tensor(STD).view(1, 3, 1, 1) * 255
        return (batch.float() - mean) / std


def build_loader(d: DataConfig, spec: LoaderSpec):
    """The loader of ``data.format`` for one split on one rank."""
    if d.format == "imagefolder":
        return MapStyleLoader(d, spec)
    if d.format == "wds":
        return WdsLoader(d, spec)
    return FfcvLoader(d, spec)
