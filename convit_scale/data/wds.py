"""WebDataset shards from ``data_prep`` (local folders or any URL webdataset opens: ``pipe:``, http), read through
``shards.py``.

Training reads canonical partitions, a function of the recipe alone: the epoch's sample sequence is the shards in a
per-epoch permuted order; its first ceil(N / repeats) samples are cut into P = K x L contiguous partitions (K the
canonical groups, L ``lanes_per_group``), each sample repeated ``repeats`` times in a row and the partition's views
streamed through a shuffle buffer seeded by (seed, epoch, partition). Step s takes v = g / L consecutive views of
each partition: group k's g views are its L lanes' v views (partitions k*L .. k*L + L - 1), at the canonical
positions of geometry.py, which seed their augmentation. A rank reads the whole partitions of its groups and nothing
else, so the sample stream is the same at any world size: a run resumed on another number of ranks continues it.
The rank's DataLoader workers each own a contiguous block of its partitions and yield, per step, their views of it;
the rank concatenates one item per worker (torch's DataLoader takes them round robin) into the step's views in
canonical order and cuts it into micro-batches: it holds one step at a time. A resume at step s0 skips each
partition's first s0 x v views without decoding them.

A sample that cannot be read or decoded is replaced by the next good sample of its partition's stream (looking ahead
of the step if need be), augmented with its own seed: a function of the partition alone, at any world size.
Evaluation reads the rank's contiguous range of the unpermuted sequence, in batches.
"""

from __future__ import annotations

import itertools
import math
from collections import deque

import numpy as np
import torch
from torch.utils.data import DataLoader, IterableDataset, get_worker_info

from ..config import DataConfig
from ..manifest import Manifest
from .batch import Batch, cat_images, cat_tensors, stack_views
from .faults import DECODE_ERRORS, CropDecodeError, DataError, limit_bad_samples, next_good, pil_rgb, reason_of
from .geometry import EpochGeometry, LoaderSpec, eval_positions, slot_positions
from .order import contiguous_range, epoch_permutation, view_seeds, views_per_rank
from .shards import shard_samples, shard_url, shuffle_buffer
from .transforms import build_eval_transform, build_train_transform, image_opener, transform_view
from .workers import iterate, loader_options

__all__ = ["WdsLoader", "lanes_per_group"]

MAX_LANES = 8
"""WebDataset partitions per canonical group at most: a rank of a job with one group per rank keeps up to this many
DataLoader workers busy (each worker reads whole partitions)."""
LOOKAHEAD = 64
"""Views of a partition's stream searched past a step for the replacement of an unreadable sample."""


def lanes_per_group(group_size: int) -> int:
    """L: the partitions of a canonical group of ``group_size`` samples, the largest divisor of it up to MAX_LANES
    (each gives group_size / L views per step)."""
    return max(lanes for lanes in range(1, min(group_size, MAX_LANES) + 1) if group_size % lanes == 0)


def decode_chunk(chunk: list, seeds, transform, replacement, where: str):
    """(images, labels, bad records) of (shard, key, jpeg, label, reason) items, each augmented from its own seed.
    An item that cannot be read or decoded takes the (image, label) that ``replacement(i, failed)`` gives (None:
    a DataError naming ``where``), augmented with its own seed."""
    images, labels, failed = [None] * len(chunk), [None] * len(chunk), {}
    decode = image_opener(transform)  # train: a JPEG's header; its crop box alone is decoded by the transform
    for i, (url, key, jpg, label, reason) in enumerate(chunk):
        if reason is None:
            try:
                img = decode(jpg)
            except DECODE_ERRORS as e:
                reason = f"undecodable image ({reason_of(e)})"
        if reason is None:
            try:
                images[i], labels[i] = transform_view(transform, img, int(seeds[i])), label
                continue
            except CropDecodeError as e:
                reason = f"undecodable image ({reason_of(e.__cause__)})"
        failed[i] = {"shard": url, "key": key, "reason": reason}
    for i, record in failed.items():
        found = replacement(i, failed)
        if found is None:
            raise DataError(f"{record['shard']}: no readable sample in {where} (key {record['key']}: "
                            f"{record['reason']})")
        images[i], labels[i] = transform_view(transform, found[0], int(seeds[i])), found[1]
    return images, labels, list(failed.values())


def _decodable(item) -> tuple | None:
    """(image, label) of an item that reads and decodes, else None."""
    _, _, jpg, label, reason = item
    if reason is not None:
        return None
    try:
        return pil_rgb(jpg), label
    except DECODE_ERRORS:
        return None


class _Partition:
    """One canonical partition's views in order: its samples (a contiguous range of the epoch's sequence), each
    ``repeats`` times, through a shuffle buffer seeded by (seed, epoch, partition); ``take`` hands them out, ``ahead``
    looks past them without taking."""

    def __init__(self, loader: "WdsLoader", epoch: int, p: int):
        lo, hi = contiguous_range(loader.unique, loader.partitions, p)
        r = loader.d.repeated_aug
        views = (item for item in loader.read_range(epoch, lo, hi) for _ in range(r))
        rng = np.random.default_rng([loader.spec.seed, epoch, p])
        self.stream, self.queued = shuffle_buffer(views, loader.partition_buffer, rng), deque()

    def take(self, n: int) -> list:
        out = [self.queued.popleft() for _ in range(min(n, len(self.queued)))]
        return out + list(itertools.islice(self.stream, n - len(out)))

    def ahead(self):
        """The views after those taken, read (and kept for ``take``) as they are asked for."""
        yield from list(self.queued)
        for item in self.stream:
            self.queued.append(item)
            yield item


class _TrainEpoch(IterableDataset):
    """The rank's training epoch from step ``first_step``: per step, one item per DataLoader worker, the views of the
    worker's block of the rank's partitions, in canonical order (``WdsLoader`` says how)."""

    def __init__(self, loader: "WdsLoader", epoch: int, first_step: int, workers: int):
        self.loader, self.epoch, self.first_step, self.workers = loader, epoch, first_step, workers

    def __iter__(self):
        ld = self.loader
        info = get_worker_info()
        lo, hi = contiguous_range(len(ld.rank_partitions), self.workers, info.id if info else 0)
        owned = ld.rank_partitions[lo:hi]
        parts = {p: _Partition(ld, self.epoch, p) for p in owned}
        for part in parts.values():  # the steps before a resume, skipped without decoding
            for _ in range(self.first_step):
                part.take(ld.views_per_step)
        for step in range(self.first_step, ld.geometry.steps):
            chunks = [self._chunk(step, p, parts[p]) for p in owned]
            yield Batch(cat_images([c.images for c in chunks]), torch.cat([c.labels for c in chunks]),
                        torch.cat([c.seeds for c in chunks]), [r for c in chunks for r in c.bad],
                        [i for c in chunks for i in c.ids])

    def _chunk(self, step: int, p: int, part: _Partition) -> Batch:
        """Partition ``p``'s views of ``step``: lane p % L of group p // L, at the canonical positions of its slots."""
        ld, v = self.loader, self.loader.views_per_step
        k, lane = divmod(p, ld.lanes)
        slots = lane * v + np.arange(v)
        seeds = view_seeds(ld.spec.seed, self.epoch, slot_positions(ld.spec, step, k, slots))
        chunk = part.take(v)

        def replacement(i: int, failed: dict):  # the next good view of the partition's stream
            later = (item for j, item in enumerate(chunk) if j > i and j not in failed)
            return next(filter(None, map(_decodable, itertools.chain(later, itertools.islice(
                part.ahead(), LOOKAHEAD)))), None)

        images, labels, bad = decode_chunk(chunk, seeds, ld.transform, replacement,
                                           f"partition {p} of epoch {self.epoch}, step {step}, and the {LOOKAHEAD} "
                                           f"views after it")
        ids = [f"{url.rsplit('/', 1)[-1]}/{key}" for url, key, *_ in chunk]
        return Batch(stack_views(images), torch.tensor(labels, dtype=torch.long),
                     torch.from_numpy(seeds.astype(np.int64)), bad, ids)


class _EvalEpoch(IterableDataset):
    """One rank's evaluation epoch as whole batches, split over DataLoader workers in contiguous batch ranges.

    The rank reads its contiguous range of the shards' sample sequence (eval positions, padded), each worker a
    contiguous piece of that. The DataLoader interleaves workers round-robin, so the k-th batch is the (k // W)-th
    batch of the worker in role k % W. After a start at batch k0, DataLoader worker i takes role (i + k0) % W, which
    keeps that order exactly.
    """

    def __init__(self, loader: "WdsLoader", epoch: int, start_batch: int):
        self.loader, self.epoch, self.start_batch = loader, epoch, start_batch

    def _views(self, first_batch: int, last_batch: int) -> list[int]:
        """Sequence positions of the views in batches [first_batch, last_batch) of this rank's range."""
        s, b = self.loader.spec, self.loader.spec.micro_batch_size
        return [int(p) for p in eval_positions(self.loader.num_samples, s)[0][first_batch * b: last_batch * b]]

    def _read(self, views: list[int]):
        """Stream (jpeg, label) for each view position, in order, reading each needed shard once."""
        ld = self.loader
        shards = ld.shards
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
                samples = shard_samples(ld.location, name, count, ld.d.open_retries, ld.d.open_retry_backoff_s,
                                        label=ld.label)
                url = shard_url(ld.location, name)
                for off, (key, jpg, label, reason) in enumerate(samples):
                    for _ in range(counts.get(lo + off, 0)):
                        yield url, key, jpg, label, reason
                    if lo + off >= hi_pos:
                        samples.close()
                        break

    def __iter__(self):
        ld, b = self.loader, self.loader.spec.micro_batch_size
        info = get_worker_info()
        worker, nw = (info.id, info.num_workers) if info else (0, 1)
        role = (worker + self.start_batch) % nw
        first, last = contiguous_range(len(ld), nw, role)
        stream = self._read(self._views(first, last))
        skip = max(0, (self.start_batch - role + nw - 1) // nw)  # batches of this role already consumed
        for j in range(last - first):
            chunk = [next(stream) for _ in range(b)] if j < last - first - 1 else list(stream)
            if j < skip:
                continue  # skipped without decoding
            yield self._batch(chunk, role + j * nw)

    def _batch(self, chunk: list, k: int) -> Batch:
        """Batch ``k`` from its (shard, key, jpeg, label, reason) items; an unreadable sample is replaced by the next
        good one of the batch (cyclically): a function of the batch alone."""
        s, b = self.loader.spec, self.loader.spec.micro_batch_size
        seeds = view_seeds(s.seed, self.epoch, s.rank * views_per_rank(self.loader.num_samples, s.world_size) + k * b
                           + np.arange(len(chunk)))

        def replacement(i: int, failed: dict):  # the next good item of the batch, decoded
            j = next_good(failed, i, len(chunk))
            return None if j is None else _decodable(chunk[j])

        images, labels, bad = decode_chunk(chunk, seeds, self.loader.transform, replacement, f"batch {k}")
        return Batch(torch.stack(images), torch.tensor(labels, dtype=torch.long), bad=bad)


class WdsLoader:
    """WebDataset shards through a torch DataLoader: training from the canonical partitions (the module says how),
    evaluation in contiguous batch ranges."""

    def __init__(self, d: DataConfig, spec: LoaderSpec, buffer_size: int = 2000):
        self.location = d.train_path if spec.train else d.val_path
        manifest = Manifest.read(self.location)
        self.location, self.label = manifest.shard_location, manifest.label_member  # `prep index --out`: elsewhere
        split = manifest.split(spec.split)
        manifest.require_classes(d.num_classes)
        if spec.train:
            manifest.require_subset(d.subset_fraction)
        self.shards = split.shards()
        self.num_samples = sum(c for _, c in self.shards)
        self.d, self.spec, self.buffer_size = d, spec, buffer_size
        on_device = spec.augment_on_device
        self.transform = (build_train_transform(d, spec.img_size, on_device, spec.handover) if spec.train
                          else build_eval_transform(d, spec.img_size, on_device))
        steps = self._layout() if spec.train else None
        self.geometry = EpochGeometry.of(self.num_samples, spec, self.location, steps)
        self.num_real = self.geometry.num_real

    def _layout(self) -> int:
        """The canonical partitions (the module says how); returns the steps of an epoch: the shortest partition's
        views // v."""
        s = self.spec
        self.lanes = lanes_per_group(s.group_size)
        self.partitions, self.views_per_step = s.groups * self.lanes, s.group_size // self.lanes
        self.unique = math.ceil(self.num_samples / self.d.repeated_aug)
        self.partition_buffer = max(1, self.buffer_size // self.lanes)  # a group's lanes share one buffer's memory
        first = s.first_group * self.lanes
        self.rank_partitions = list(range(first, first + s.rank_groups * self.lanes))
        return self.d.repeated_aug * (self.unique // self.partitions) // self.views_per_step

    def __len__(self) -> int:
        return self.geometry.num_batches

    def read_range(self, epoch: int, lo: int, hi: int):
        """(shard url, key, jpeg, label, reason) of positions [lo, hi) of the epoch's shard-permuted sequence."""
        order = [self.shards[i] for i in epoch_permutation(len(self.shards), self.spec.seed, epoch)]
        start = 0
        for name, count in order:
            if start < hi and start + count > lo:
                samples = shard_samples(self.location, name, count, self.d.open_retries, self.d.open_retry_backoff_s,
                                        label=self.label)
                url = shard_url(self.location, name)
                for off, (key, jpg, label, reason) in enumerate(samples):
                    if start + off >= hi:
                        samples.close()
                        break
                    if start + off >= lo:
                        yield url, key, jpg, label, reason
            start += count

    def epoch(self, epoch: int, start_batch: int = 0):
        if not self.spec.train:
            workers = min(self.d.num_workers, len(self))
            loader = DataLoader(_EvalEpoch(self, epoch, start_batch), batch_size=None,
                                pin_memory=self.spec.pin_memory, **loader_options(workers, self.spec.seed, epoch))
            yield from limit_bad_samples(iterate(loader), self.d.max_bad_samples, epoch, self.spec.rank)
            return
        yield from limit_bad_samples(self._train_batches(epoch, start_batch), self.d.max_bad_samples, epoch,
                                     self.spec.rank)

    def _train_batches(self, epoch: int, start_batch: int):
        """The micro-batches from ``start_batch`` on: each step assembled from one item per worker, in order."""
        s, m = self.spec, self.spec.micro_batch_size
        per_step = s.batches_per_step  # the rank's samples of a step in batches of m
        first_step, skip = divmod(start_batch, per_step)
        workers = min(self.d.num_workers, len(self.rank_partitions))
        loader = DataLoader(_TrainEpoch(self, epoch, first_step, max(1, workers)), batch_size=None,
                            **loader_options(workers, s.seed, epoch))
        items = iterate(loader)
        try:
            for step in range(first_step, self.geometry.steps):
                parts = [next(items) for _ in range(max(1, workers))]  # one per worker, round robin: in order
                # pinned (the copy to the GPU overlaps compute) as they are joined: micro-batches are slices of these
                images = cat_images([p.images for p in parts], s.pin_memory)
                labels = cat_tensors([p.labels for p in parts], s.pin_memory)
                seeds = torch.cat([p.seeds for p in parts])
                ids, bad = [i for p in parts for i in p.ids], [r for p in parts for r in p.bad]
                for j in range(skip if step == first_step else 0, per_step):
                    rows = slice(j * m, (j + 1) * m)
                    yield Batch(images[rows], labels[rows], seeds[rows], bad if j == per_step - 1 else [],
                                ids[rows])
        finally:
            items.close()
