"""FFCV's compiled stages for timm's pixels: decode, seeded crop and flip, eval view, labels, timm's augmentation.

ffcv compiles each stage with numba and runs it on the loader's threads (``ffcv_epoch.py``). Each JPEG is decoded as
PIL decodes it (``jpeg.py``), the train crop drawn from the view's seed (``splitmix_numba.py``) and resized with
PIL's resampling (``resample.py``); a view's id carries its file index and its seed (``ID_BITS``). In training the
crop box is drawn from the image's size (the .beton's metadata) before decoding, and only the box is decoded
(``jpeg.decode_rgb_box``: the same pixels as the whole decode then the crop, about half the work).
"""

from __future__ import annotations

from dataclasses import replace

import numba
import numpy as np
import torch
from PIL import Image

from ..ffcv_threads import importing_ffcv

with importing_ffcv():
    from ffcv.fields.basics import IntDecoder
    from ffcv.fields.rgb_image import IMAGE_MODES, RandomResizedCropRGBImageDecoder
    from ffcv.pipeline.compiler import Compiler
    from ffcv.pipeline.operation import Operation

from .. import jpeg_roi
from ..jpeg import decode_rgb_box
from .batch import Boxes, Encoded
from .ffcv_epoch import SlotScratch
from .private_aug import PrivateAugment
from .resample import FILTERS, eval_short_side, resized_center_crop, resized_crop
from .sample import flipped, seeded_crop
from .transforms import MEAN, STD

ID_BITS = np.uint64(32)  # a view id: the view's seed << 32 | the file index
FILE_INDEX = np.uint64(2**32 - 1)
REPLACED = np.uint64(2**63)  # set on a view id by the decoder when the view's JPEG failed to decode (seeds < 2**31)



@numba.njit(nogil=True)
def _flip_in_place(img):  # (H, W, 3) uint8
    width = img.shape[1]
    for r in range(img.shape[0]):
        for c in range(width // 2):
            for ch in range(img.shape[2]):
                t = img[r, c, ch]
                img[r, c, ch] = img[r, width - 1 - c, ch]
                img[r, width - 1 - c, ch] = t


@numba.njit(nogil=True)
def _whole_image(height, width, view_seed):
    """The eval view's box: the whole image (decoded whole: ``jpeg.decode_rgb_box`` then calls turbojpeg)."""
    return 0, 0, int(height), int(width)


def _train_box(scale, log_ratio):
    """Compiled ``(height, width, view_seed) -> (i, j, h, w)``: the view's RandomResizedCrop box (``seeded_crop``)."""

    def box(height, width, view_seed):
        return seeded_crop(height, width, scale, log_ratio, view_seed)

    return Compiler.compile(box)


def _decode_or_next(mem_read, group: int, box_of=_whole_image):
    """Compiled ``(batch_indices, dst_ix, metadata, storage_state, scratch, whole, view_seed) -> (i, j, h, w,
    stride)``: the box ``box_of(height, width, view_seed)`` of the image of view ``dst_ix`` of a batch, in
    ``scratch`` as flat RGB rows ``stride`` pixels wide, with its top left corner at row ``i``, column ``j``: a
    JPEG's box alone, decoded as PIL decodes the image (``jpeg.decode_rgb_box``: i = j = 0, stride = w), or a raw
    image copied as stored (one type of buffer for the resize to read, whatever the image's mode), else, if its JPEG
    is refused, the box of the next view of its group (cyclically: ``group`` views, the canonical group in
    training, so the replacement is the same at any world size; 0: the whole batch) that decodes, with ``REPLACED``
    set on the view's id in place (the epoch's batches are views of the order FfcvLoader keeps), where FfcvLoader
    finds it to fix the label and list it. ffcv's own decoders ignore what turbojpeg returns: a corrupt JPEG
    silently becomes whatever the buffer held. If no view of the group decodes, a box of the view's own size at the
    start of ``scratch``: FfcvLoader raises for that batch.

    ``whole`` (the file's largest image's bytes; may be ``scratch`` where ``scratch`` holds that much) takes a JPEG
    decoded whole (``jpeg.decode_rgb_box`` where the crop-region decoder refuses it: a truncated file, which
    turbojpeg decodes to its last row before it refuses it): nothing is written to ``scratch`` past the box returned.
    The box is drawn from the size the .beton records (its header's), before decoding: a replacement's box is drawn
    over the replacement's size, as when it was decoded whole first. Where what a candidate would write (its box, or
    a raw image whole) does not fit ``scratch``, nothing is written and ``(-1, 0, 0, 0, bytes needed)`` is returned:
    the caller gives it more room and asks again (a slot's packed hand-over, ``_HandoverDecoder``)."""
    jpg = IMAGE_MODES["jpg"]

    def decode_or_next(batch_indices, dst_ix, metadata, storage_state, scratch, whole, view_seed):
        n = group if group > 0 else len(batch_indices)
        base = dst_ix - dst_ix % n
        own = metadata[batch_indices[dst_ix] & FILE_INDEX]
        for attempt in range(n):  # the view itself, else the next one of the group that decodes
            field = metadata[batch_indices[base + (dst_ix - base + attempt) % n] & FILE_INDEX]
            image_data = mem_read(field["data_ptr"], storage_state)
            src_h, src_w = np.uint32(field["height"]), np.uint32(field["width"])
            i, j, h, w = box_of(src_h, src_w, view_seed)
            need = image_data.size if field["mode"] != jpg else int(h) * int(w) * 3
            if need > scratch.size:
                return -1, 0, 0, 0, need
            if field["mode"] != jpg:
                scratch[:image_data.size] = image_data
                return i, j, h, w, int(src_w)
            if decode_rgb_box(image_data, scratch, whole, src_h, src_w, i, j, h, w) == 0:
                return 0, 0, h, w, w
            if attempt == 0:
                batch_indices[dst_ix] = batch_indices[dst_ix] | REPLACED
        _, _, h, w = box_of(np.uint32(own["height"]), np.uint32(own["width"]), view_seed)
        if int(h) * int(w) * 3 > scratch.size:
            return -1, 0, 0, 0, int(h) * int(w) * 3
        return 0, 0, h, w, w

    return Compiler.compile(decode_or_next)


class _TimmPixelsDecoder(RandomResizedCropRGBImageDecoder):
    """What both decoders share: their memory (the output, one scratch row for the largest image, one for the
    resize's horizontal pass) and their filter (``data.interpolation``, PIL's).

    ffcv gives every image of every slot a scratch row (batch x the largest height x the largest width x 3 bytes
    per slot: with the originals kept and a 4000 x 5000 largest photograph, 3.8 GB of address space per slot at
    batch 64); here a slot has one row, and only the bytes of the images it decoded are ever touched (a JPEG decoded
    into a cold row, then read by the resize, costs memory traffic too: BENCHMARKS.md, "FFCV loader: measurements
    behind its design")."""

    def __init__(self, output_size, interpolation: str, scale=(0.08, 1.0), group: int = 0):
        super().__init__(output_size, scale=tuple(scale), ratio=(3 / 4, 4 / 3))
        self.kind, self.group = FILTERS[interpolation], group

    def declare_state_and_memory(self, previous_state):
        state, (output, _) = super().declare_state_and_memory(previous_state)
        largest = np.uint64(self.max_height) * np.uint64(self.max_width) * np.uint64(3)
        mid = np.uint64(self.max_height) * np.uint64(self.output_size[1]) * np.uint64(3)
        return state, (output, SlotScratch((largest,), np.dtype("<u1")), SlotScratch((mid,), np.dtype("<u1")))


class SeededCropFlipDecoder(_TimmPixelsDecoder):
    """Decode, RandomResizedCrop (scale ``crop_scale``, ratio 3/4-4/3) and horizontal flip in one compiled stage,
    with the parameters drawn from the view's seed (the high bits of the id) rather than numba's unseeded generator,
    and the crop resized as timm does (``resample.resized_crop``).

    A view whose JPEG fails to decode takes the next view of its canonical group (``group`` views) that decodes
    (``_decode_or_next``), cropped and flipped with its own seed. Only the crop box is decoded (``jpeg_roi``; without
    its library, the whole image, said once)."""

    def __init__(self, output_size, flip_prob: float, scale=(0.08, 1.0), interpolation: str = "bicubic",
                 group: int = 0):
        super().__init__(output_size, interpolation, scale, group)
        self.flip_prob = flip_prob

    def generate_code(self):
        scale, log_ratio, flip_prob, kind = (np.array(self.scale), np.log(np.array(self.ratio)), self.flip_prob,
                                             self.kind)
        jpeg_roi.warn_if_missing("the FFCV train decoder")
        decode_or_next = _decode_or_next(self.memory_read, self.group, _train_box(scale, log_ratio))

        def decode(batch_indices, my_storage, metadata, storage_state):
            destination, scratch, mid = my_storage[0], my_storage[1][0], my_storage[2][0]
            for dst_ix in range(len(batch_indices)):
                view_seed = (batch_indices[dst_ix] & ~REPLACED) >> ID_BITS
                i, j, h, w, stride = decode_or_next(batch_indices, dst_ix, metadata, storage_state, scratch, scratch,
                                                    view_seed)
                resized_crop(scratch, stride, i, j, h, w, destination[dst_ix], kind, mid)
                if flipped(view_seed, flip_prob):
                    _flip_in_place(destination[dst_ix])
            return destination[:len(batch_indices)]

        return decode


class TimmEvalDecoder(_TimmPixelsDecoder):
    """timm's eval view in one compiled stage: decode, resize the shorter side to ``img_size / crop_ratio`` (256 for
    224 at 0.875), centre-crop ``img_size`` (``resample.resized_center_crop``).

    A JPEG that fails to decode is handled as in training (``_decode_or_next``), and as the ImageFolder and
    WebDataset eval loaders handle an unreadable file: FfcvLoader fixes the label, lists the view and counts it
    against ``data.max_bad_samples``."""

    def __init__(self, output_size, crop_ratio: float, interpolation: str = "bicubic"):
        super().__init__(output_size, interpolation)
        self.short_side = eval_short_side(output_size[0], crop_ratio)

    def generate_code(self):
        decode_or_next, short_side, kind = _decode_or_next(self.memory_read, 0), self.short_side, self.kind

        def decode(batch_indices, my_storage, metadata, storage_state):
            destination, scratch, mid = my_storage[0], my_storage[1][0], my_storage[2][0]
            for dst_ix in range(len(batch_indices)):
                _, _, height, width, _ = decode_or_next(batch_indices, dst_ix, metadata, storage_state, scratch,
                                                        scratch, np.uint64(0))
                resized_center_crop(scratch, height, width, short_side, destination[dst_ix], kind, mid)
            return destination[:len(batch_indices)]

        return decode


class ViewLabelDecoder(IntDecoder):
    """The label of a view id (its low bits are the file index)."""

    def generate_code(self):
        def decoder(indices, destination, metadata, storage_state):
            for ix in range(len(indices)):
                destination[ix] = metadata[indices[ix] & FILE_INDEX]
            return destination[:len(indices)]

        return decoder


class PrivateTimmStage(Operation):
    """timm's RandAugment, normalisation and random erasing per view, seeded by the view (not compiled:
    runs in ffcv's iterator thread, on private generators; see private_aug.py)."""

    def __init__(self, augment: PrivateAugment, size: int):
        super().__init__()
        self.augment, self.size = augment, size

    def generate_code(self):
        augment = self.augment

        def run(images, _, indices):  # images: (B, S, S, 3) uint8 from the decoder
            return torch.stack([augment(Image.fromarray(img), int((view & ~REPLACED) >> ID_BITS))
                                for img, view in zip(images, indices)])

        run.with_indices = True
        return run

    def declare_state_and_memory(self, previous_state):
        return replace(previous_state, jit_mode=False, shape=(3, self.size, self.size), dtype=torch.float32), None


class EvalNormalize(torch.nn.Module):
    def forward(self, batch: torch.Tensor) -> torch.Tensor:
        mean = torch.tensor(MEAN).view(1, 3, 1, 1) * 255
        std = torch.tensor(STD).view(1, 3, 1, 1) * 255
        return (batch.float() - mean) / std


HEADER = 64
"""Bytes of a handed-over view's header (``SeededBoxDecoder``, ``SeededJpegDecoder``): little-endian uint32 words.
A batch's views are packed into its slot's arena: the headers of its B views first, then their payloads one after
the other, in view order."""

ARENA_MARGIN = 1.125
"""A packed slot's room above the largest batch of the epoch it was sized for (``handover_bytes``): the next epochs'
batches draw other boxes and mostly fit without allocating again."""


@numba.njit(nogil=True)
def _put(row, word, value):
    for k in range(4):
        row[4 * word + k] = (value >> (8 * k)) & 255


@numba.njit(nogil=True)
def _compact_box(buf, stride, i, j, h, w):
    """The (h, w) box at row i, column j of ``buf`` (RGB rows ``stride`` pixels wide) moved to its start, compact, in
    place (every byte moves towards the start: a forward copy)."""
    if i == 0 and j == 0 and stride == w:
        return
    for r in range(h):
        src, dst = ((i + r) * stride + j) * 3, r * w * 3
        for k in range(w * 3):
            buf[dst + k] = buf[src + k]


@numba.njit(nogil=True)
def _grown(arena, used, need):
    """A (1, n) arena of at least ``need`` bytes (twice the old one's, at least) holding the old one's first ``used``
    bytes: the batch's own memory, where a replacement's box did not fit the slot (the consumer copies out of it as
    out of the slot)."""
    bigger = np.empty((1, max(need, 2 * arena.shape[1])), np.uint8)
    bigger[0, :used] = arena[0, :used]
    return bigger


@numba.njit(nogil=True)
def _largest_batch(views, heights, widths, stored, raw, batch, boxes, scale, log_ratio):
    """The bytes of the epoch's largest batch of packed views (headers and payloads), ``views`` in their order:
    a box mode view's box (a raw image's whole pixels, copied before its box is moved to the start), else the
    view's stored bytes."""
    best = 0
    for b0 in range(0, len(views), batch):
        b1 = min(b0 + batch, len(views))
        total = (b1 - b0) * HEADER
        for v in range(b0, b1):
            f = views[v] & FILE_INDEX
            if boxes and not raw[f]:
                _, _, h, w = seeded_crop(heights[f], widths[f], scale, log_ratio, (views[v] & ~REPLACED) >> ID_BITS)
                total += int(h) * int(w) * 3
            else:
                total += int(stored[f])
        best = max(best, total)
    return best


def handover_bytes(kind: str, reader, field: str, views: np.ndarray, batch: int, scale=(0.08, 1.0),
                   ratio=(3 / 4, 4 / 3)) -> int:
    """The largest batch of ``views`` (ids, in the epoch's order) packed as ``kind`` ("box" or "jpeg") hands over,
    in bytes, from the sizes ``reader`` (an ffcv ``Reader``) records for the image field ``field``: what a slot's
    arena must hold for the epoch without allocating (a replaced view's box, drawn over its replacement, may not)."""
    meta = reader.metadata[f"f{reader.field_names.index(field)}"]
    table = np.sort(reader.alloc_table, order="ptr")
    stored = table["size"][np.searchsorted(table["ptr"], meta["data_ptr"])].astype(np.int64)
    raw = np.ascontiguousarray(meta["mode"] != IMAGE_MODES["jpg"])
    heights = np.ascontiguousarray(meta["height"]).astype(np.uint32)
    widths = np.ascontiguousarray(meta["width"]).astype(np.uint32)
    return int(_largest_batch(np.ascontiguousarray(views, dtype=np.uint64), heights, widths, stored, raw, int(batch),
                              kind == "box", np.array(scale, dtype=np.float64),
                              np.log(np.array(ratio, dtype=np.float64))))


class _HandoverDecoder(RandomResizedCropRGBImageDecoder):
    """A batch of train views handed over to the training device (``device_images.py``), packed into its slot's
    arena of ``arena`` bytes (``HEADER``): the slot holds what its batch hands over, not a row per view sized for
    the file's largest image (a .beton of the originals, whose largest photograph is tens of MB, hands over as a
    .beton of 512-pixel images does). ``FfcvLoader`` sizes the arena for each epoch's largest batch
    (``handover_bytes``); a batch that still does not fit (a replaced view's box drawn over a larger image) is
    packed into memory of its own (``_grown``). The decoder's output is the (1, n) arena."""

    def __init__(self, flip_prob: float, scale=(0.08, 1.0), group: int = 0, arena: int = 0):
        super().__init__((1, 1), scale=tuple(scale), ratio=(3 / 4, 4 / 3))
        self.flip_prob, self.group, self.arena = flip_prob, group, int(arena)

    def declare_state_and_memory(self, previous_state):
        shape, dtype = (max(self.arena, 1),), np.dtype("<u1")
        return replace(previous_state, jit_mode=True, shape=shape, dtype=dtype), (SlotScratch(shape, dtype),)


class SeededBoxDecoder(_HandoverDecoder):
    """``SeededCropFlipDecoder`` without its resize (``data.resize_on: device``): the same box decoded (a view whose
    JPEG fails takes the next one of its group that decodes, ``_decode_or_next``) and the same flip drawn, handed
    over at the box's own size: words h, w, flip, then the (h, w, 3) pixels (``batch.Boxes``). A JPEG the
    crop-region decoder refuses is decoded whole into a scratch row of the slot's own (sized for the file's largest
    image, as the pixel decoders' row: address space, touched only by such a file), never into the packed arena."""

    def declare_state_and_memory(self, previous_state):
        state, memory = super().declare_state_and_memory(previous_state)
        largest = np.uint64(self.metadata["height"].max()) * np.uint64(self.metadata["width"].max()) * np.uint64(3)
        return state, (*memory, SlotScratch((largest,), np.dtype("<u1")))

    def generate_code(self):
        scale, log_ratio, flip_prob = np.array(self.scale), np.log(np.array(self.ratio)), self.flip_prob
        jpeg_roi.warn_if_missing("the FFCV train decoder")
        decode_or_next = _decode_or_next(self.memory_read, self.group, _train_box(scale, log_ratio))

        def decode(batch_indices, my_storage, metadata, storage_state):
            arena, whole = my_storage[0], my_storage[1][0]
            n = len(batch_indices)
            used = n * HEADER
            for dst_ix in range(n):
                view_seed = (batch_indices[dst_ix] & ~REPLACED) >> ID_BITS
                while True:  # the box decoded straight into the arena (a raw image: copied, then its box moved)
                    i, j, h, w, stride = decode_or_next(batch_indices, dst_ix, metadata, storage_state,
                                                        arena[0, used:], whole, view_seed)
                    if i >= 0:
                        break
                    arena = _grown(arena, used, used + stride)
                _compact_box(arena[0, used:], stride, i, j, h, w)
                head = arena[0, dst_ix * HEADER:]
                _put(head, 0, h)
                _put(head, 1, w)
                _put(head, 2, 1 if flipped(view_seed, flip_prob) else 0)
                used += int(h) * int(w) * 3
            return arena

        return decode


class SeededJpegDecoder(_HandoverDecoder):
    """The view undecoded (``data.decode_on: device``): its box drawn from the size the .beton records and its flip,
    as ``SeededCropFlipDecoder`` draws them, handed over with the file's bytes: words length, kind (0 JPEG, 1 raw
    pixels), height, width, top, left, box height, box width, flip, then the payload (``batch.Encoded``)."""

    def generate_code(self):
        scale, log_ratio, flip_prob = np.array(self.scale), np.log(np.array(self.ratio)), self.flip_prob
        box_of, mem_read, jpg = _train_box(scale, log_ratio), self.memory_read, IMAGE_MODES["jpg"]

        def decode(batch_indices, my_storage, metadata, storage_state):
            arena = my_storage[0]
            n = len(batch_indices)
            used = n * HEADER
            for dst_ix in range(n):
                view_seed = (batch_indices[dst_ix] & ~REPLACED) >> ID_BITS
                field = metadata[batch_indices[dst_ix] & FILE_INDEX]
                data = mem_read(field["data_ptr"], storage_state)
                src_h, src_w = np.uint32(field["height"]), np.uint32(field["width"])
                i, j, h, w = box_of(src_h, src_w, view_seed)
                if used + data.size > arena.shape[1]:
                    arena = _grown(arena, used, used + data.size)
                arena[0, used:used + data.size] = data
                head = arena[0, dst_ix * HEADER:]
                _put(head, 0, data.size)
                _put(head, 1, 0 if field["mode"] == jpg else 1)
                _put(head, 2, src_h)
                _put(head, 3, src_w)
                _put(head, 4, i)
                _put(head, 5, j)
                _put(head, 6, h)
                _put(head, 7, w)
                _put(head, 8, 1 if flipped(view_seed, flip_prob) else 0)
                used += data.size
            return arena

        return decode


def unpack_views(arena: torch.Tensor, count: int, kind: str, pin: bool = False):
    """The ``batch.Boxes`` ("box") or ``batch.Encoded`` ("jpeg") of a batch of ``count`` views packed in ``arena``
    (the decoder's (1, n) output: ffcv's slot, reused, or the batch's own), their payloads copied out in one copy,
    boxes into page-locked memory with ``pin`` (a copy to the GPU; JPEGs stay pageable: the decoder reads them on
    the host, ``Encoded.pin_memory``)."""
    flat = arena.reshape(-1)
    words = flat[:count * HEADER].view(count, HEADER)[:, :36].contiguous().view(torch.int32).long()
    total = int((words[:, 0] * words[:, 1] * 3 if kind == "box" else words[:, 0]).sum())
    start = count * HEADER
    payload = torch.empty(total, dtype=torch.uint8, pin_memory=pin and kind == "box")  # JPEGs: read on the host
    payload.copy_(flat[start:start + total])
    if kind == "box":
        return Boxes(payload, words[:, :2].clone(), words[:, 2].bool())
    return Encoded(payload, words[:, :8].clone(), words[:, 8].bool())
