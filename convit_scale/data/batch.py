"""What every loader yields: a batch that unpacks as ``x, y = batch`` and carries what the loop needs beside."""

from __future__ import annotations

import functools

import numpy as np
import torch
from torch.utils.data import default_collate


class Batch:
    """``images`` (B, 3, S, S): float and normalised when the loader augments on the CPU, uint8 crops when the
    training device augments; or, for the training device to finish, the crop boxes at their own size (``Boxes``) or
    the views undecoded (``Encoded``). In training ``seeds`` holds each sample's seed, int64 (B,) on the CPU (the device
    augmentation's and drop-path's draws), and ``ids`` each sample's identity (dataset index, or "shard/key" for
    WebDataset). ``bad`` lists the samples that could not be read and were replaced, as dicts (shard or file, key,
    reason)."""

    __slots__ = ("images", "labels", "seeds", "bad", "ids")

    def __init__(self, images: torch.Tensor, labels: torch.Tensor, seeds: torch.Tensor | None = None,
                 bad: list[dict] | tuple = (), ids: list | None = None):
        self.images, self.labels, self.seeds, self.bad, self.ids = images, labels, seeds, list(bad), ids

    def __iter__(self):
        return iter((self.images, self.labels))

    def __getstate__(self):
        return (self.images, self.labels, self.seeds, self.bad, self.ids)

    def __setstate__(self, state):
        self.images, self.labels, self.seeds, self.bad, self.ids = state

    def pin_memory(self) -> "Batch":
        """Page-locked host memory (torch's DataLoader calls this in its pin thread), so that the copy to the GPU
        with ``non_blocking=True`` overlaps compute."""
        return Batch(self.images.pin_memory(), self.labels.pin_memory(),
                     None if self.seeds is None else self.seeds.pin_memory(), self.bad, self.ids)


class Boxes:
    """Training views handed over as their crop boxes at their own size (``data.resize_on: device``): the training
    device resizes them to the model's input (``device_resize.resize_packed``), flips and augments them.

    ``pixels`` uint8 (N,): the boxes one after another, each (h, w, 3) row-major; ``sizes`` int64 (B, 2): each box's
    (h, w); ``flips`` bool (B,): flip after the resize."""

    __slots__ = ("pixels", "sizes", "flips")

    def __init__(self, pixels: torch.Tensor, sizes: torch.Tensor, flips: torch.Tensor):
        self.pixels, self.sizes, self.flips = pixels, sizes, flips

    @classmethod
    def of(cls, views: list) -> "Boxes":
        """Packed from (uint8 (h, w, 3) array, flip) pairs."""
        sizes = torch.tensor([box.shape[:2] for box, _ in views], dtype=torch.int64).reshape(-1, 2)
        pixels = (torch.from_numpy(np.concatenate([np.ascontiguousarray(box).reshape(-1) for box, _ in views]))
                  if views else torch.empty(0, dtype=torch.uint8))
        return cls(pixels, sizes, torch.tensor([bool(f) for _, f in views], dtype=torch.bool))

    def __len__(self) -> int:
        return self.sizes.shape[0]

    def _spans(self) -> torch.Tensor:
        lengths = self.sizes.prod(1) * 3
        return torch.stack([torch.cumsum(lengths, 0) - lengths, lengths], 1)

    def __getitem__(self, rows) -> "Boxes":
        if isinstance(rows, slice) and rows.step in (None, 1):  # a micro-batch: views of the pinned step's memory
            start, stop, _ = rows.indices(len(self))
            spans = self._spans()
            lo = int(spans[start, 0]) if start < stop else 0
            hi = int(spans[stop - 1].sum()) if start < stop else 0
            return Boxes(self.pixels[lo:hi], self.sizes[rows], self.flips[rows])
        index = torch.arange(len(self))[rows]
        spans = self._spans()[index]
        if index.numel() and bool((index[1:] - index[:-1] == 1).all()):  # consecutive: one slice of the buffer
            start, end = int(spans[0, 0]), int(spans[-1].sum())
            pixels = self.pixels[start:end]
        else:
            pixels = torch.cat([self.pixels[int(s):int(s) + int(n)] for s, n in spans.tolist()] or
                               [self.pixels[:0]])
        return Boxes(pixels, self.sizes[index], self.flips[index])

    @staticmethod
    def cat(parts: list["Boxes"], pin: bool = False) -> "Boxes":
        return Boxes(cat_tensors([p.pixels for p in parts], pin), cat_tensors([p.sizes for p in parts], pin),
                     cat_tensors([p.flips for p in parts], pin))

    def pin_memory(self) -> "Boxes":
        return Boxes(self.pixels.pin_memory(), self.sizes.pin_memory(), self.flips.pin_memory())

    def __getstate__(self):
        return self.pixels, self.sizes, self.flips

    def __setstate__(self, state):
        self.pixels, self.sizes, self.flips = state


class Encoded:
    """Training views handed over undecoded (``data.decode_on: device``): the training device decodes each JPEG,
    crops its box, resizes it to the model's input and flips it (``device_images.py``).

    ``data`` uint8 (N,): the views' payloads one after another; ``meta`` int64 (B, 8) per view: payload length,
    kind (``JPEG``: the file's bytes; ``RAW``: (height, width, 3) pixels the loader decoded, an image that is not
    a JPEG), the image's height and width, the box's top, left, height, width; ``flips`` bool (B,)."""

    JPEG, RAW = 0, 1
    __slots__ = ("data", "meta", "flips")

    def __init__(self, data: torch.Tensor, meta: torch.Tensor, flips: torch.Tensor):
        self.data, self.meta, self.flips = data, meta, flips

    @classmethod
    def of(cls, views: list) -> "Encoded":
        """Packed from (payload bytes or uint8 array, kind, (height, width), (top, left, h, w), flip) tuples."""
        payloads = [np.frombuffer(p, dtype=np.uint8) if isinstance(p, (bytes, bytearray, memoryview))
                    else np.ascontiguousarray(p).reshape(-1) for p, *_ in views]
        meta = torch.tensor([[len(p), kind, *size, *box] for p, (_, kind, size, box, _) in zip(payloads, views)],
                            dtype=torch.int64).reshape(-1, 8)
        data = torch.from_numpy(np.concatenate(payloads)) if views else torch.empty(0, dtype=torch.uint8)
        return cls(data, meta, torch.tensor([bool(v[-1]) for v in views], dtype=torch.bool))

    def __len__(self) -> int:
        return self.meta.shape[0]

    def payloads(self) -> list[torch.Tensor]:
        """Each view's payload, a view of ``data``."""
        return list(torch.split(self.data, self.meta[:, 0].tolist()))

    def __getitem__(self, rows) -> "Encoded":
        if isinstance(rows, slice) and rows.step in (None, 1):  # a micro-batch: views, no copy
            start, stop, _ = rows.indices(len(self))
            ends = torch.cumsum(self.meta[:, 0], 0)
            lo = int(ends[start - 1]) if start > 0 and start < stop else 0
            hi = int(ends[stop - 1]) if start < stop else 0
            return Encoded(self.data[lo:hi], self.meta[rows], self.flips[rows])
        index = torch.arange(len(self))[rows]
        chunks = self.payloads()
        data = torch.cat([chunks[i] for i in index.tolist()] or [self.data[:0]])
        return Encoded(data, self.meta[index], self.flips[index])

    @staticmethod
    def cat(parts: list["Encoded"], pin: bool = False) -> "Encoded":
        return Encoded(torch.cat([p.data for p in parts]), torch.cat([p.meta for p in parts]),
                       cat_tensors([p.flips for p in parts], pin))

    def pin_memory(self) -> "Encoded":
        """The flips page-locked (they move to the device); the payloads stay: the decoder reads them on the host."""
        return Encoded(self.data, self.meta, self.flips.pin_memory())

    def __getstate__(self):
        return self.data, self.meta, self.flips

    def __setstate__(self, state):
        self.data, self.meta, self.flips = state


def stack_views(views: list):
    """One batch's images from its views: uint8/float tensors stacked, crop boxes (``(array, flip)``) packed as
    ``Boxes``, undecoded views (5-tuples) as ``Encoded``."""
    first = views[0]
    if isinstance(first, torch.Tensor):  # in a DataLoader worker: straight into shared memory
        return default_collate(views)
    return Boxes.of(views) if len(first) == 2 else Encoded.of(views)


def cat_tensors(parts: list[torch.Tensor], pin: bool = False) -> torch.Tensor:
    """``torch.cat``; with ``pin``, straight into page-locked memory: one copy of a step's images on the training
    thread, not a cat and then a pin (two)."""
    if not pin:
        return torch.cat(parts)
    first = parts[0]
    if not all(p.is_contiguous() for p in parts):  # a channels-last view: cat keeps its layout, then the pin
        return torch.cat(parts).pin_memory()
    dtype = functools.reduce(torch.promote_types, (p.dtype for p in parts))  # as torch.cat promotes
    out = torch.empty((sum(p.shape[0] for p in parts), *first.shape[1:]), dtype=dtype, pin_memory=True)
    return torch.cat(parts, out=out)


def cat_images(parts: list, pin: bool = False):
    """``torch.cat`` for every kind of batch images (tensors, ``Boxes``, ``Encoded``); with ``pin``, as
    ``Batch.pin_memory`` leaves them, in one copy (``cat_tensors``)."""
    return cat_tensors(parts, pin) if isinstance(parts[0], torch.Tensor) else type(parts[0]).cat(parts, pin)
