"""A rank's training micro-batches assembled from one canonical group per batch, for ranks whose micro-batches are
not all of ``micro_batch_size`` samples (unequal shares of the canonical groups, or a micro-batch that does not divide
the rank's share): geometry.py says how a step's groups are cut. Every rank yields ``accum`` micro-batches a step; a
part with no samples (``MicroPart.samples == 0``) is the rank's previous micro-batch again, with no ids and no bad
samples, which the step weights 0."""

from __future__ import annotations

import itertools

from .batch import Batch, cat_images, cat_tensors
from .faults import DataError
from .geometry import LoaderSpec


def join(batches: list[Batch], pin: bool) -> Batch:
    """One batch of ``batches`` in order (no copy for one; with ``pin``, joined straight into page-locked memory)."""
    if len(batches) == 1:
        return batches[0]
    return Batch(cat_images([b.images for b in batches], pin), cat_tensors([b.labels for b in batches], pin),
                 None if batches[0].seeds is None else cat_tensors([b.seeds for b in batches], pin),
                 [r for b in batches for r in b.bad], [i for b in batches for i in (b.ids or ())])


class StepBatches:
    """The Loader contract (data/__init__.py) over a format loader that reads ``spec.per_group()``: ``accum``
    micro-batches per step on every rank, cut as ``spec.micro_parts`` says."""

    def __init__(self, inner, spec: LoaderSpec):
        self.inner, self.spec = inner, spec
        self.num_samples, self.num_real = inner.num_samples, inner.num_real
        self.steps = len(inner) // inner.spec.batches_per_step

    def __len__(self) -> int:
        return self.steps * self.spec.accum

    def epoch(self, epoch: int, start_batch: int = 0):
        """The micro-batches of ``epoch`` from ``start_batch`` (counted in micro-batches of every rank) on."""
        parts, per_step = self.spec.micro_parts, self.inner.spec.batches_per_step
        first_step, skip = divmod(start_batch, len(parts))
        groups = self.inner.epoch(epoch, start_batch=first_step * per_step)
        try:
            for step in range(first_step, self.steps):
                batches = list(itertools.islice(groups, per_step))
                if len(batches) < per_step:
                    raise DataError(f"the training loader ended in step {step} of epoch {epoch}")
                start, last = 0, None
                for j, part in enumerate(parts):
                    if part.samples:
                        last = join(batches[start:start + part.groups], self.spec.pin_memory)
                        start += part.groups
                        out = last
                    else:  # the last micro-batch again, weighted 0: the collectives of a micro-step, no gradient
                        out = Batch(last.images, last.labels, last.seeds, (), [])
                    if step > first_step or j >= skip:
                        yield out
        finally:
            groups.close()
