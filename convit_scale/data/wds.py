"""WebDataset shards from ``data_prep`` (local folders or any URL webdataset opens: ``pipe:``, http).

Shards are read in a per-epoch permuted order; each rank reads its contiguous range of the sample
sequence through DataLoader workers, and augmentation is seeded per sample, so a resumed epoch is
bit-identical.
"""

from __future__ import annotations

import io
import json
import math
import tarfile
from pathlib import Path

import numpy as np
import torch
from PIL import Image
from torch.utils.data import DataLoader, IterableDataset, get_worker_info

from ..config import DataConfig
from .batch import Batch
from .geometry import DataError, EpochGeometry, LoaderSpec, eval_positions
from .plan import contiguous_range, epoch_permutation, sample_seed
from .transforms import build_eval_transform, build_train_transform, seed_all
from .workers import private_generator, worker_init_fn


def _decode(data: bytes) -> Image.Image:
    return Image.open(io.BytesIO(data)).convert("RGB")


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
            images, seeds = [], [sample_seed(s.seed, self.epoch, s.rank, k * b + i) for i in range(len(chunk))]
            for i, (jpg, _) in enumerate(chunk):
                seed_all(seeds[i])
                images.append(ld.transform(_decode(jpg)))
            yield Batch(torch.stack(images), torch.tensor([label for _, label in chunk], dtype=torch.long),
                        torch.tensor(seeds, dtype=torch.int64) if s.train and s.augment_on_device else None)


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
    """WebDataset shards through a torch DataLoader whose workers read contiguous batch ranges."""

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
        on_device = spec.augment_on_device
        self.transform = (build_train_transform(d, spec.img_size, on_device) if spec.train
                          else build_eval_transform(d, spec.img_size, on_device))
        self.geometry = EpochGeometry.of(self.num_samples, spec, self.location)
        self.views_per_rank, self.num_real = self.geometry.views_per_rank, self.geometry.num_real

    def __len__(self) -> int:
        return self.geometry.num_batches

    def shard_order(self, epoch: int) -> list[tuple[str, int]]:
        if not self.spec.train:
            return self.shards
        return [self.shards[i] for i in epoch_permutation(len(self.shards), self.spec.seed, epoch)]

    def epoch(self, epoch: int, start_batch: int = 0):
        workers = min(self.d.num_workers, len(self))
        loader = DataLoader(_WdsEpoch(self, epoch, start_batch), batch_size=None, num_workers=workers,
                            generator=private_generator(self.spec.seed, epoch), worker_init_fn=worker_init_fn(),
                            pin_memory=self.spec.pin_memory)
        yield from loader
