"""What every loader yields: a batch that unpacks as ``x, y = batch`` and carries what the loop needs beside."""

from __future__ import annotations

import torch


class Batch:
    """``images`` (B, 3, S, S): float and normalised when the loader augments on the CPU, uint8 crops when the
    training device augments. In training ``seeds`` holds each sample's seed, int64 (B,) on the CPU (the device
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
