"""FFCV .beton files through ffcv's Loader, with the epoch plan as its traversal order.

This module imports ffcv; ``build_loader`` imports it only for ``data.format: ffcv``. The pixels are timm's: each
JPEG is decoded as PIL decodes it (``jpeg.py``: turbojpeg with libjpeg's defaults, where ffcv's own decoder uses
its fast inverse DCT), the train crop is resized and the eval view made with PIL's own resampling (``resample.py``:
bicubic by default, antialiased, the eval image resized to a shorter side of ``img_size / eval_crop_ratio`` and
centre-cropped), where ffcv resizes with OpenCV's INTER_AREA and crops the eval centre square before resizing.
For the same crop box they give timm's pixels exactly. RandAugment, normalisation and random erasing are timm's.
"""

from __future__ import annotations

import math
import queue
import threading
from dataclasses import replace
from pathlib import Path

import numba
import numpy as np
import torch
from PIL import Image

from ..ffcv_threads import importing_ffcv

with importing_ffcv():
    import ffcv.loader.loader as ffcv_loader_module
    from ffcv.fields.basics import IntDecoder
    from ffcv.fields.rgb_image import IMAGE_MODES, RandomResizedCropRGBImageDecoder
    from ffcv.loader import Loader
    from ffcv.loader.epoch_iterator import select_buffer
    from ffcv.loader.loader import ORDER_MAP
    from ffcv.memory_managers.os_cache import OSCacheManager
    from ffcv.pipeline.allocation_query import AllocationQuery
    from ffcv.pipeline.compiler import Compiler
    from ffcv.pipeline.operation import Operation
    from ffcv.transforms import Squeeze, ToTensor, ToTorchImage
    from ffcv.traversal_order.base import TraversalOrder

from timm.data import create_transform

from ..config import DataConfig
from ..jpeg import decode_rgb
from ..manifest import Manifest
from .batch import Batch
from .faults import DataError, limit_bad_samples, next_good, reason_of
from .geometry import EpochGeometry, LoaderSpec
from .order import view_seeds
from .private_aug import PrivateAugment
from .resample import FILTERS, eval_short_side, resized_center_crop, resized_crop
from .transforms import MEAN, STD


class PlanOrder(TraversalOrder):
    """The epoch plan as ffcv's traversal order. ffcv asks for ``sample_order(epoch)`` with its own epoch
    counter; the epoch and the resume position are the plan's, so FfcvLoader puts the order of the next
    iteration on the ffcv Loader (``plan_order``) before iterating it. ffcv's constructor asks once, to
    size its ``len()``: then it gets the whole subset, which is never shorter than a rank's epoch."""

    def sample_order(self, epoch: int) -> np.ndarray:
        return getattr(self.loader, "plan_order", self.indices)


def _serial(cls, n: int) -> None:
    """ffcv's ``Compiler.set_num_threads(n)`` sets numba's and torch's thread counts to n, for every Loader and
    epoch, and makes the decoders compile with numba's prange over the batch. Here they compile serial: the loader's
    threads run a batch each (``_EpochIterator``), and torch's count is the training step's (OMP_NUM_THREADS)."""
    cls.num_threads = 1


Compiler.set_num_threads = classmethod(_serial)

_READ_ONLY_BYTES = numba.types.Array(numba.uint8, 1, "C", readonly=True)


def _state_type(self):
    """ffcv's ``OSCacheManager.state_type`` without its side effect. ffcv sets ``mutable = False`` on the object
    ``numba.uint8[::1]`` returns, which is numba's one shared type of every writable uint8 vector: from then on such
    vectors type as read-only in the whole process, a write into one no longer compiles, and numba's tables keyed
    by that type break (a KeyError when a second pipeline calls a compiled function a first one called)."""
    return numba.types.Tuple([_READ_ONLY_BYTES, numba.uint64[::1], numba.uint64[::1]])


def _compile_reader(self):
    """ffcv's ``OSCacheManager.compile_reader``, typed with a read-only type of its own (``_state_type``)."""
    def read(address, mem_state):
        size = mem_state[2][np.searchsorted(mem_state[1], address)]
        return mem_state[0][address:address + size]

    return Compiler.compile(read, _READ_ONLY_BYTES(numba.uint64, self.state_type))


OSCacheManager.state_type = property(_state_type)
OSCacheManager.compile_reader = _compile_reader

ORDER_KEY = "convit_scale_plan"
ORDER_MAP[ORDER_KEY] = PlanOrder  # ffcv refuses an order class that is not registered


def subset_indices(manifest: Manifest, split: str, fraction: float) -> tuple[str, np.ndarray]:
    """The .beton of ``split`` and the file indices of its Table 2 subset (the first files of each class:
    files are written in sorted (class, file) order)."""
    info = manifest.split(split)
    (name,) = info.files
    counts = info.class_counts(manifest.num_classes)
    starts = np.cumsum([0] + counts)
    return name, np.concatenate([np.arange(s, s + math.floor(c * fraction)) for s, c in zip(starts, counts)])


ID_BITS = np.uint64(32)  # a view id: the view's seed << 32 | the file index
FILE_INDEX = np.uint64(2**32 - 1)
REPLACED = np.uint64(2**63)  # set on a view id by the decoder when the view's JPEG failed to decode (seeds < 2**31)


@numba.njit(nogil=True)
def _uniform(view_seed, k):
    """The k-th uniform draw in [0, 1) of a view: splitmix64 of (seed, k), no generator state."""
    x = view_seed * np.uint64(64) + np.uint64(k) + np.uint64(0x9E3779B97F4A7C15)
    x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    x = x ^ (x >> np.uint64(31))
    return (x >> np.uint64(11)) * (1.0 / 9007199254740992.0)


@numba.njit(nogil=True)
def _seeded_crop(height, width, scale, log_ratio, view_seed):
    """ffcv's (torchvision's) RandomResizedCrop parameters (i, j, h, w), drawn from the view's seed."""
    area = height * width
    for attempt in range(10):
        target_area = area * (scale[0] + (scale[1] - scale[0]) * _uniform(view_seed, 4 * attempt))
        aspect_ratio = np.exp(log_ratio[0] + (log_ratio[1] - log_ratio[0]) * _uniform(view_seed, 4 * attempt + 1))
        w = int(round(np.sqrt(target_area * aspect_ratio)))
        h = int(round(np.sqrt(target_area / aspect_ratio)))
        if 0 < w <= width and 0 < h <= height:
            i = int(_uniform(view_seed, 4 * attempt + 2) * (height - h + 1))
            j = int(_uniform(view_seed, 4 * attempt + 3) * (width - w + 1))
            return i, j, h, w
    in_ratio = float(width) / float(height)  # fallback: the centre crop of the clamped ratio
    w, h = int(width), int(height)
    if in_ratio < np.exp(log_ratio[0]):
        h = int(round(w / np.exp(log_ratio[0])))
    elif in_ratio > np.exp(log_ratio[1]):
        w = int(round(h * np.exp(log_ratio[1])))
    return (int(height) - h) // 2, (int(width) - w) // 2, h, w


@numba.njit(nogil=True)
def _flip_in_place(img):  # (H, W, 3) uint8
    width = img.shape[1]
    for r in range(img.shape[0]):
        for c in range(width // 2):
            for ch in range(img.shape[2]):
                t = img[r, c, ch]
                img[r, c, ch] = img[r, width - 1 - c, ch]
                img[r, width - 1 - c, ch] = t


def _decode_or_next(mem_read, group: int):
    """Compiled ``(batch_indices, dst_ix, metadata, storage_state, scratch) -> (height, width)``: the image of view
    ``dst_ix`` of a batch as flat RGB bytes (``height x width x 3``) in ``scratch``, decoded as PIL decodes it
    (``jpeg.decode_rgb``) or copied as stored (a raw image: one type of buffer for the resize to read, whatever the
    image's mode), else, if turbojpeg refuses its JPEG, the next view of its group (cyclically: ``group`` views, the
    canonical group in training, so the replacement is the same at any world size; 0: the whole batch) that decodes,
    with ``REPLACED`` set on the view's id in place (ffcv passes the traversal order's own memory), where FfcvLoader
    finds it to fix the label and list it. ffcv's own decoders ignore what turbojpeg returns: a corrupt JPEG
    silently becomes whatever the buffer held. If no view of the group decodes, the view's own size over
    ``scratch``: FfcvLoader raises for that batch."""
    jpg = IMAGE_MODES["jpg"]

    def decode_or_next(batch_indices, dst_ix, metadata, storage_state, scratch):
        n = group if group > 0 else len(batch_indices)
        base = dst_ix - dst_ix % n
        own = metadata[batch_indices[dst_ix] & FILE_INDEX]
        height, width = np.uint32(own["height"]), np.uint32(own["width"])
        for attempt in range(n):  # the view itself, else the next one of the group that decodes
            field = metadata[batch_indices[base + (dst_ix - base + attempt) % n] & FILE_INDEX]
            image_data = mem_read(field["data_ptr"], storage_state)
            src_h, src_w = np.uint32(field["height"]), np.uint32(field["width"])
            if field["mode"] != jpg:
                scratch[:image_data.size] = image_data
                return src_h, src_w
            if decode_rgb(image_data, scratch, src_h, src_w) == 0:
                return src_h, src_w
            if attempt == 0:
                batch_indices[dst_ix] = batch_indices[dst_ix] | REPLACED
        return height, width

    return Compiler.compile(decode_or_next)


class SlotScratch(AllocationQuery):
    """Memory a decoder needs once per batch slot, not once per image: ``_allocate`` gives it one row per slot. A
    batch is one thread's (``_EpochIterator``) and its images are decoded one after the other into that row."""


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
    (``_decode_or_next``), cropped and flipped with its own seed."""

    def __init__(self, output_size, flip_prob: float, scale=(0.08, 1.0), interpolation: str = "bicubic",
                 group: int = 0):
        super().__init__(output_size, interpolation, scale, group)
        self.flip_prob = flip_prob

    def generate_code(self):
        decode_or_next = _decode_or_next(self.memory_read, self.group)
        scale, log_ratio, flip_prob, kind = (np.array(self.scale), np.log(np.array(self.ratio)), self.flip_prob,
                                             self.kind)

        def decode(batch_indices, my_storage, metadata, storage_state):
            destination, scratch, mid = my_storage[0], my_storage[1][0], my_storage[2][0]
            for dst_ix in range(len(batch_indices)):
                view_seed = (batch_indices[dst_ix] & ~REPLACED) >> ID_BITS
                height, width = decode_or_next(batch_indices, dst_ix, metadata, storage_state, scratch)
                i, j, h, w = _seeded_crop(height, width, scale, log_ratio, view_seed)
                resized_crop(scratch, width, i, j, h, w, destination[dst_ix], kind, mid)
                if _uniform(view_seed, 40) < flip_prob:
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
                height, width = decode_or_next(batch_indices, dst_ix, metadata, storage_state, scratch)
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


class _EvalNormalize(torch.nn.Module):
    def forward(self, batch: torch.Tensor) -> torch.Tensor:
        mean = torch.tensor(MEAN).view(1, 3, 1, 1) * 255
        std = torch.tensor(STD).view(1, 3, 1, 1) * 255
        return (batch.float() - mean) / std


def _allocate(graph, batch_size: int, slots: int) -> dict:
    """ffcv's ``Graph.allocate_memory`` without page-locking: ffcv pins every buffer when CUDA is available, for
    its own device copies. Batches leave these buffers through the consumer's copy (into page-locked memory when
    the run pins), so they stay pageable, and what the decoders never touch (the scratch rows past a slot's first)
    takes no memory."""
    requirements, _ = graph.collect_requirements()

    def one(q: AllocationQuery):
        rows = 1 if isinstance(q, SlotScratch) else batch_size
        if isinstance(q.dtype, torch.dtype):
            return [torch.empty(rows, *q.shape, dtype=q.dtype, device=q.device) for _ in range(slots)]
        return np.empty((slots, rows, *q.shape), dtype=q.dtype)

    return {kind: {node: (one(q) if isinstance(q, AllocationQuery) else
                          tuple(one(x) for x in q) if isinstance(q, (tuple, list)) else None)
                   for node, q in queries.items()}
            for kind, queries in requirements.items()}


def run_stages(loader: Loader, memory: dict, slot: int, batch_indices: np.ndarray, storage_state, metadata):
    """ffcv's ``EpochIterator.run_pipeline`` for a pipeline that stays on the CPU (no CUDA stream of its own): the
    loader's compiled stages on slot ``slot`` of ``memory`` (``_allocate``'s buffers)."""
    code, outputs = loader.code
    args = {"batch_indices": batch_indices, "storage_state": storage_state, "metadata": metadata,
            **{f"{kind}_{k}": select_buffer(v, slot, len(batch_indices))
               for prefix, kind in (("operation", "memory"), ("shared", "shared_memory"))
               for k, v in memory[prefix].items()}}
    for stage_code, define_outputs in code:
        for node_id, result in zip(define_outputs, stage_code(**args)):
            args[f"result_{node_id}"] = result
    return tuple(args[f"result_{x}"] for x in outputs)


class _EpochIterator:
    """One epoch of an ffcv Loader on ``num_workers`` threads that each run whole batches (batch k on thread
    k mod num_workers), handed out in order. ffcv's own runs one batch at a time on one thread, its decoders spread
    over the batch by numba's prange: every batch ends at a barrier (the threads that finish first wait for the
    last) and the batch's serial work runs with the other threads idle (what that costs: BENCHMARKS.md, "FFCV loader:
    measurements behind its design"). The threads are the epoch's: none outlives it. turbojpeg keeps a handle per
    thread that ffcv never frees: a few KB per thread and epoch, some tens of MB over a 300-epoch run.

    A thread that fails hands its exception to the consumer, which raises it naming the .beton (ffcv's thread
    died with it and its consumer waited on the queue for ever). ``close()`` stops and joins the threads.

    Slots: thread k writes batch b into slot b mod S of the loader's buffers. Thread k starts batch b only once
    b - N is in its queue (q batches at most), so the consumer has taken b - (q + 1) N and holds nothing older
    than that; every batch alive lies in (b - (q + 1) N, b], and S = (q + 1) N + 1 slots never collide. With one
    thread and q = batches_ahead that is ffcv's batches_ahead + 2. The buffers are the loader's, kept across epochs
    (ffcv allocated, and the kernel zeroed, hundreds of MB per epoch), so one epoch of a loader runs at a time: a
    new one closes the one before."""

    def __init__(self, loader: Loader, order: np.ndarray):
        if not isinstance(loader.memory_manager, OSCacheManager):  # the others schedule reads for one thread
            raise ValueError(f"{loader.fname}: the FFCV loader's threads need os_cache=True")
        previous = getattr(loader, "live_epoch", None)
        if previous is not None:
            previous.superseded = True
            previous.close()
        self.loader, self.num_threads = loader, max(1, loader.num_workers)
        self.batches = [order[i:i + loader.batch_size] for i in range(0, len(order), loader.batch_size)]
        ahead = max(1, -(-loader.batches_ahead // self.num_threads))
        self.slots = (ahead + 1) * self.num_threads + 1
        if getattr(loader, "epoch_buffers", (0, None))[0] != self.slots:
            loader.epoch_buffers = (self.slots, _allocate(loader.graph, loader.batch_size, self.slots))
        self.memory = loader.epoch_buffers[1]
        self.memory_context = loader.memory_manager.schedule_epoch(self.batches)  # the reads of the .beton
        self.memory_context.__enter__()
        self.storage_state, self.metadata = self.memory_context.state, loader.reader.metadata
        self.queues = [queue.Queue(ahead) for _ in range(self.num_threads)]
        self.stop, self.next_batch, self.closed, self.superseded = threading.Event(), 0, False, False
        self.threads = [threading.Thread(target=self._work, args=(k,), daemon=True, name=f"ffcv-epoch-{k}")
                        for k in range(self.num_threads)]
        loader.live_epoch = self
        try:
            for t in self.threads:
                t.start()
        except BaseException:
            self.close()
            raise

    def run_pipeline(self, b_ix: int, batch_indices: np.ndarray, slot: int):
        return run_stages(self.loader, self.memory, slot, batch_indices, self.storage_state, self.metadata)

    def _work(self, k: int) -> None:
        try:
            for b in range(k, len(self.batches), self.num_threads):
                if self.stop.is_set() or not self._put(k, self.run_pipeline(b, self.batches[b], b % self.slots)):
                    return
            self._put(k, None)
        except BaseException as e:  # noqa: BLE001 - handed to the consumer, which raises it
            self._put(k, e)

    def _put(self, k: int, item) -> bool:
        while not self.stop.is_set():
            try:
                self.queues[k].put(item, timeout=0.5)
                return True
            except queue.Full:
                pass
        return False

    def __iter__(self):
        return self

    def __next__(self):
        if self.closed:
            if self.superseded:
                raise RuntimeError(f"{self.loader.fname}: this epoch was closed when a new epoch of the same loader "
                                   "started (its buffers are shared: one epoch of a loader at a time)")
            raise StopIteration()
        result = self.queues[self.next_batch % self.num_threads].get()
        if isinstance(result, BaseException):
            self.close()
            raise RuntimeError(f"{self.loader.fname}: ffcv's loader thread failed: {reason_of(result)}") from result
        if result is None:
            self.close()
            raise StopIteration()
        self.next_batch += 1
        return result

    def close(self) -> None:
        """Stop the threads and wait for them (one blocked on a full queue is let go by the stop flag)."""
        self.closed = True
        self.stop.set()
        for t in self.threads:
            while t.is_alive() and t is not threading.current_thread():
                for q in self.queues:
                    try:
                        q.get_nowait()
                    except queue.Empty:
                        pass
                t.join(timeout=0.05)
        if self.loader.live_epoch is self:
            self.loader.live_epoch = None
            self.memory_context.__exit__(None, None, None)


ffcv_loader_module.EpochIterator = _EpochIterator  # what ffcv's Loader.__iter__ starts


class FfcvLoader:
    """FFCV .beton through ffcv's Loader with the epoch plan as its traversal order.

    Train crops, flips and the timm augmentation that follows are drawn from the view's seed, a function
    of (seed, epoch, position in the epoch): the same batches for any ``num_workers`` and after a resume.
    """

    def __init__(self, d: DataConfig, spec: LoaderSpec):
        location = Path(d.train_path if spec.train else d.val_path)
        name, indices = subset_indices(Manifest.read(location), spec.split, d.subset_fraction if spec.train else 1.0)
        self.num_samples = len(indices)
        self.d, self.spec, self._indices = d, spec, indices.astype(np.uint64)
        self.geometry = EpochGeometry.of(self.num_samples, spec, str(location))
        self.num_real = self.geometry.num_real
        self._path, self._loader = location / name, None

    def __len__(self) -> int:
        return self.geometry.num_batches

    def _image_pipeline(self) -> list:
        d, size, on_device = self.d, self.spec.img_size, self.spec.augment_on_device
        if not self.spec.train:
            return [TimmEvalDecoder((size, size), d.eval_crop_ratio, d.interpolation), ToTensor(),
                    ToTorchImage(channels_last=False)] + ([] if on_device else [_EvalNormalize()])
        crop = SeededCropFlipDecoder((size, size), d.hflip, d.crop_scale, d.interpolation, self.spec.group_size)
        if on_device:  # uint8 crops, channels-last; RandAugment, normalisation and erasing run on the training device
            return [crop, ToTensor(), ToTorchImage()]

        _, secondary, final = create_transform(
            input_size=size, is_training=True, hflip=0.0, color_jitter=d.color_jitter,
            auto_augment=d.rand_augment, interpolation=d.interpolation, re_prob=d.reprob,
            re_mode="pixel", re_count=1, separate=True)
        return [crop, PrivateTimmStage(PrivateAugment(secondary, final), size)]

    def _ffcv_loader(self) -> Loader:
        """Built once: each ffcv Loader compiles its pipeline with numba (seconds)."""
        if self._loader is None:
            self._loader = Loader(
                str(self._path), batch_size=self.spec.micro_batch_size, num_workers=max(1, self.d.num_workers),
                order=ORDER_KEY, indices=self._indices, seed=self.spec.seed, drop_last=self.spec.train,
                os_cache=True, pipelines={"image": self._image_pipeline(), "label": [ViewLabelDecoder(), ToTensor(),
                                                                                     Squeeze()]})
        return self._loader

    def views(self, epoch: int, start_batch: int = 0) -> np.ndarray:
        """The ids ffcv passes through the pipeline for this rank's views from ``start_batch`` on: the file
        index in the low 32 bits, the view's augmentation seed (train: of its position in the epoch) in the high 32."""
        samples, positions = self.geometry.sample_indices(epoch, self.d.repeated_aug, start_batch)
        views = self._indices[samples]
        if self.spec.train:
            views = views | (view_seeds(self.spec.seed, epoch, positions) << ID_BITS)
        return views

    def epoch(self, epoch: int, start_batch: int = 0):
        """Batches ``start_batch``.. of ``epoch``. Closing the generator (or dropping it) stops ffcv's thread."""
        loader = self._ffcv_loader()
        loader.plan_order = order = self.views(epoch, start_batch)
        it = iter(loader)
        try:
            yield from limit_bad_samples(self._batches(it, order), self.d.max_bad_samples, epoch, self.spec.rank)
        finally:
            it.close()

    def _batches(self, it, order: np.ndarray):
        first = 0
        for images, labels in it:
            # ffcv reuses its output buffers: copy what leaves the loader. In device-augmentation mode the images
            # stay channels-last (NCHW over the decoder's NHWC memory): a plain copy here, and the transposition
            # happens on the training device (device_augment), not in this thread, which every batch passes through.
            # With pinning, the one copy goes straight into page-locked memory (clone, then pin, would be two).
            images = (torch.empty_like(images, pin_memory=True).copy_(images) if self.spec.pin_memory
                      else images.clone())
            labels = labels.clone().long()
            views = order[first:first + len(labels)]  # the decoder marked replaced views before ffcv queued the batch
            first += len(labels)
            failed = {int(i) for i in np.flatnonzero(views & REPLACED)}
            bad = []
            group = self.spec.group_size if self.spec.train else len(labels)
            for i in sorted(failed):  # the decoder took the next view of the group that decodes: so does the label
                base = i - i % group
                j = next_good({f - base for f in failed if base <= f < base + group}, i - base, group)
                if j is None:
                    raise DataError(f"{self._path}: no decodable image in a group of {group} (file indices "
                                    f"{(views[base:base + 4] & FILE_INDEX).tolist()}...)")
                labels[i] = labels[base + j]
                bad.append({"file": str(self._path), "key": int(views[i] & FILE_INDEX),
                            "reason": "undecodable JPEG (turbojpeg refused it)"})
            seeds = ids = None  # training: the views' seeds (device augmentation, drop-path) and file indices
            if self.spec.train:
                seeds = torch.from_numpy(((views & ~REPLACED) >> ID_BITS).astype(np.int64))
                ids = (views & FILE_INDEX).astype(np.int64).tolist()
            batch = Batch(images, labels, seeds, bad=bad, ids=ids)
            yield batch.pin_memory() if self.spec.pin_memory else batch  # images: already pinned, kept as they are
