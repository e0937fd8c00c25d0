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
other modes) and listed with the batch's bad samples.
"""

from __future__ import annotations

import io

import numpy as np
import torch
from PIL import Image
from torchvision.io import ImageReadMode, decode_jpeg

from .batch import Batch, Boxes, Encoded
from .device_resize import resize_list, resize_packed
from .faults import DECODE_ERRORS, DataError, next_good, reason_of


def batch_on_device(batch: Batch, device: torch.device, size: int, group: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(uint8 (B, 3, size, size) images, int64 labels) of ``batch`` on ``device``; views the device could not decode
    are replaced within their group of ``group`` views and appended to ``batch.bad``."""
    images, labels = batch.images, batch.labels.to(device, non_blocking=True)
    if isinstance(images, torch.Tensor):
        return images.to(device, non_blocking=True), labels
    if isinstance(images, Boxes):
        return resize_packed(images.pixels.to(device, non_blocking=True), images.sizes, size,
                             images.flips.to(device, non_blocking=True)), labels
    out, failed = decode_views(images, device, size)
    if failed:
        for i, record in failed.items():
            batch.bad.append({"key": batch.ids[i] if batch.ids else i, "reason": record["reason"]})
        out, labels = _replace(out, labels, failed, group)
    return out, labels


def decode_views(views: Encoded, device: torch.device, size: int) -> tuple[torch.Tensor, dict]:
    """The views decoded on ``device`` (JPEGs in one batched call), cropped, resized to ``size`` and flipped, and
    {index: bad-sample record} of those that did not decode anywhere (their images are zeros)."""
    payloads, meta = views.payloads(), views.meta.tolist()
    crops: list[torch.Tensor | None] = [None] * len(views)
    failed: dict[int, dict] = {}
    jpegs = [i for i, m in enumerate(meta) if m[1] == Encoded.JPEG]
    for i, image in zip(jpegs, _decode_jpegs([payloads[i] for i in jpegs], device)):
        if isinstance(image, str):
            failed[i] = {"reason": f"undecodable JPEG ({image})"}
        else:
            crops[i] = image
    for i, m in enumerate(meta):
        if m[1] == Encoded.RAW:
            crops[i] = payloads[i].view(m[2], m[3], 3).permute(2, 0, 1).to(device, non_blocking=True)
    for i, m in enumerate(meta):
        if crops[i] is not None:
            top, left, h, w = m[4:8]
            crops[i] = crops[i][:, top:top + h, left:left + w]
    good = [i for i in range(len(views)) if crops[i] is not None]
    if len(good) == len(views):
        return resize_list(crops, size, views.flips.to(device, non_blocking=True)), failed
    flips = views.flips[good].to(device)
    out = torch.zeros(len(views), 3, size, size, dtype=torch.uint8, device=device)
    if good:
        out[torch.tensor(good, device=device)] = resize_list([crops[i] for i in good], size, flips)
    return out, failed


def _decode_jpegs(payloads: list[torch.Tensor], device: torch.device) -> list:
    """(3, H, W) uint8 images on ``device``, or the reason a payload decodes nowhere: the batch in one call of the
    device's decoder; if it refuses the batch, each image alone, and those it refuses by PIL on the host."""
    if not payloads:
        return []
    try:
        return list(decode_jpeg(payloads, mode=ImageReadMode.RGB, device=device))
    except RuntimeError:
        pass
    out = []
    for data in payloads:
        try:
            out.append(decode_jpeg(data, mode=ImageReadMode.RGB, device=device))
        except RuntimeError:
            out.append(_host_decode(data, device))
    return out


def _host_decode(data: torch.Tensor, device: torch.device):
    try:
        with Image.open(io.BytesIO(data.numpy().tobytes())) as img:
            pixels = np.asarray(img.convert("RGB"))
    except DECODE_ERRORS as e:
        return reason_of(e)
    return torch.from_numpy(pixels.copy()).permute(2, 0, 1).to(device)


def _replace(images: torch.Tensor, labels: torch.Tensor, failed: dict, group: int):
    """Each failed view takes the next view of its canonical group that decoded: its image and its label."""
    for i in sorted(failed):
        base = i - i % group
        j = next_good({f - base for f in failed if base <= f < base + group}, i - base, group)
        if j is None:
            raise DataError(f"no view of canonical group {i // group} of the batch decodes "
                            f"({failed[i]['reason']})")
        images[i], labels[i] = images[base + j], labels[base + j]
    return images, labels
