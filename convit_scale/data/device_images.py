"""The training device's share of the loader's work: the batch a loader handed over, as uint8 (B, 3, S, S) images on
the device, before ``device_augment.augment_batch``.

What the loader hands over, by ``data.resize_on`` and ``data.decode_on`` (``LoaderSpec.handover``):

| handover | the CPU (loader)                                 | the training device (here)                       |
| -------- | ------------------------------------------------ | ------------------------------------------------ |
| pixels   | decodes the crop box, resizes it, flips it       | moves the (B, 3, S, S) crops                     |
| box      | decodes the crop box (``batch.Boxes``)           | resizes every box to S x S and flips it, the     |
|          |                                                  | whole batch at once (``device_resize``)          |
| jpeg     | reads the file and draws the box from the JPEG   | decodes the batch (nvJPEG through torchvision on |
|          | header's size (``batch.Encoded``)                | CUDA; on a CPU device torchvision's CPU decoder  |
|          |                                                  | stands in), crops, resizes, flips                |

A JPEG the device's decoder refuses is decoded on the host (PIL) and counted; one that neither decodes is replaced by
the next view of its canonical group that did (its image and label, as the loaders replace an undecodable view in the
other modes) and listed with the batch's bad samples, which the training step counts against data.max_bad_samples on
every rank alike (its all-reduced count).
"""

from __future__ import annotations

import torch

from .batch import Batch, Boxes, Encoded
from .device_resize import Decoded, decode_crop_resize, decode_crops, resize_packed, resized
from .faults import next_good


def batch_on_device(batch: Batch, device: torch.device, size: int, group: int,
                    broken: list[str] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(uint8 (B, 3, size, size) images, int64 labels) of ``batch`` on ``device``; views the device could not decode
    are replaced within their group of ``group`` views and appended to ``batch.bad``. A decoder that refused the
    whole batch (``device_resize.REFUSED_ALL_AT``) is appended to ``broken``, or, without it, raises ``DataError``."""
    images, labels = batch.images, batch.labels.to(device, non_blocking=True)
    if isinstance(images, torch.Tensor):
        return images.to(device, non_blocking=True), labels
    if isinstance(images, Boxes):
        return resize_packed(images.pixels.to(device, non_blocking=True), images.sizes, size,
                             images.flips.to(device, non_blocking=True)), labels
    out, failed = decode_views(images, device, size, broken)
    if failed:
        for i, record in failed.items():
            batch.bad.append({"key": batch.ids[i] if batch.ids else i, "reason": record["reason"], "device": True})
        out, labels = _replace(out, labels, failed, group)
    return out, labels


class StepImages:
    """``batch_on_device`` for an epoch's micro-batches in turn. A part with no samples (``MicroPart.samples == 0``) is
    the previous micro-batch again (the same ``Batch.images``, ``data/steps.py``): it gets the tensors made for that one
    instead of a second copy, decode and resize. They are kept only while the next part is such a repeat. ``prepare``
    makes a micro-batch's tensors before it is asked for (the next step's first, while the device finishes this one),
    its device augmentation too.

    ``broken``: why the device's decoder refused a whole batch (``device_resize.REFUSED_ALL_AT``), of the batches made
    since the training step last took them: it raises them on every rank alike (``StepTotals.decoder_broken``)."""

    def __init__(self, device: torch.device, size: int, group: int):
        self.device, self.size, self.group = device, size, group
        self._held: tuple | None = None
        self._augmented: tuple | None = None
        self.broken: list[str] = []

    def __call__(self, batch: Batch, repeated_next: bool) -> tuple[torch.Tensor, torch.Tensor]:
        """(images, labels) of ``batch`` on the device; ``repeated_next``: the next micro-batch repeats this one."""
        held, self._held = self._held, None
        if held is not None and held[0] is batch.images:
            out = held[1]
            if isinstance(out, BaseException):  # made early, it failed: raised now, in its turn
                raise out
        else:
            out = batch_on_device(batch, self.device, self.size, self.group, self.broken)
        if repeated_next:
            self._held = (batch.images, out)
        return out

    def prepare(self, batch: Batch, augment=None) -> None:
        """Make ``batch``'s tensors now, for the call that asks for them next (nothing else may come between), and,
        with ``augment`` (``augment(images, seeds)``, the device augmentation), its augmented images for
        ``augmented``. The device's out-of-memory error drops what was made (the step's gradients are still held
        now): that call makes it again, in its turn. Any other error (a decoder's fault) is kept and raised by it."""
        self._augmented = self._held = None
        try:
            out = batch_on_device(batch, self.device, self.size, self.group, self.broken)
            if augment is not None:
                self._augmented = (batch.images, augment(out[0], batch.seeds))
        except torch.OutOfMemoryError:
            return
        except Exception as e:
            out = e
        self._held = (batch.images, out)

    def augmented(self, batch: Batch):
        """The augmented images ``prepare`` made for ``batch``, once (a repeat of it is augmented in its turn), else
        None."""
        held, self._augmented = self._augmented, None
        return held[1] if held is not None and held[0] is batch.images else None

    def take_broken(self) -> list[str]:
        """The decoders' reports of the batches made until now, cleared here."""
        broken, self.broken = self.broken, []
        return broken


REFUSED = [0]
"""JPEGs the device's decoder refused that PIL decoded on the host, in this process (the training log counts them)."""


def decode_views(views: Encoded, device: torch.device, size: int,
                 broken: list[str] | None = None) -> tuple[torch.Tensor, dict]:
    """The views decoded on ``device`` (the JPEGs in one batched call; those its decoder refuses, and the images the
    loader decoded, cut on the host and moved in one copy: ``device_resize.decode_crop_resize``), cropped, resized
    to ``size`` and flipped, and {index: bad-sample record} of those that decoded nowhere (zeros). ``broken``: as
    ``batch_on_device`` takes it."""
    payloads, meta = views.payloads(), views.meta
    pixels = {i: payloads[i].numpy().reshape(height, width, 3)  # images the loader decoded (not JPEGs)
              for i, (kind, height, width) in enumerate(meta[:, 1:4].tolist()) if kind == Encoded.RAW}
    done = _decode_on_its_stream(payloads, meta[:, 4:8], size, views.flips, device, pixels, broken)
    REFUSED[0] += done.refused
    return done.images, {i: {"reason": f"undecodable JPEG ({why})"} for i, why in done.failed.items()}


_STREAMS: dict = {}


def _decode_on_its_stream(payloads: list, boxes: torch.Tensor, size: int, flips: torch.Tensor, device: torch.device,
                          pixels: dict, broken: list[str] | None = None) -> Decoded:
    """``decode_crop_resize`` with the decode on a CUDA stream of its own and the resize on the training stream.
    torchvision's nvJPEG decode allocates its outputs on the current stream but writes them on a private one that
    waits for no other: from the training stream's pool it could be handed memory that queued training kernels still
    read. On its own stream, its allocations come from that stream's pool, whose earlier work is finished first; the
    training stream then waits for the crops and resizes them, its working memory (up to ``CHUNK_BYTES`` a chunk)
    from the training stream's pool, where the step's activations, freed by then, can reuse it: on the decode's
    stream it would stay reserved beside them."""
    flips = flips.to(device, non_blocking=True)
    if device.type != "cuda":
        return decode_crop_resize(payloads, boxes, size, flips, device, pixels, broken)
    if device not in _STREAMS:
        _STREAMS[device] = torch.cuda.Stream(device)
    stream = _STREAMS[device]
    current = torch.cuda.current_stream(device)
    stream.synchronize()  # the previous batch's decode: no block of this stream's pool is still written
    with torch.cuda.stream(stream):
        crops, refused, failed = decode_crops(payloads, boxes, device, pixels, broken)
    current.wait_stream(stream)
    for crop in crops:  # their blocks go back to the decode's pool only once the training stream has read them
        crop.record_stream(current)
    return resized(crops, refused, failed, size, flips, device)


def _replace(images: torch.Tensor, labels: torch.Tensor, failed: dict, group: int):
    """Each failed view takes the next view of its canonical group that decoded: its image and its label."""
    for i in sorted(failed):
        base = i - i % group
        j = next_good({f - base for f in failed if base <= f < base + group}, i - base, group)
        if j is not None:  # (no view of the group decodes: its images stay black, counted like the others: the
            images[i], labels[i] = images[base + j], labels[base + j]  # step's all-reduced count stops every rank)
    return images, labels
