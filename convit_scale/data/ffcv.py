"""FFCV .beton files through ffcv's Loader, with the epoch plan as the order of its views.

The module's neighbours do the rest: ``ffcv_decoders.py`` the compiled stages (timm's pixels: each JPEG decoded as
PIL decodes it, the train crop resized and the eval view made with PIL's resampling, where ffcv's own decoder uses
its fast inverse DCT and OpenCV's INTER_AREA; for the same crop box they give timm's pixels exactly), and
``ffcv_epoch.py`` the threads that run them; ``ffcv_threads.importing_ffcv`` imports ffcv and fixes it. This module
imports ffcv; ``build_loader`` imports it only for ``data.format: ffcv``.
"""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import torch

from ..ffcv_threads import importing_ffcv

with importing_ffcv():
    from ffcv.loader import Loader, OrderOption
    from ffcv.reader import Reader
    from ffcv.transforms import Squeeze, ToTensor, ToTorchImage

from timm.data import create_transform

from ..config import DataConfig
from ..manifest import FFCV_FIELDS, Manifest, read_ffcv_labels
from .batch import Batch
from .faults import DataError, limit_bad_samples, next_good
from .ffcv_decoders import (
    ARENA_MARGIN,
    FILE_INDEX,
    ID_BITS,
    REPLACED,
    EvalNormalize,
    PrivateTimmStage,
    SeededBoxDecoder,
    SeededCropFlipDecoder,
    SeededJpegDecoder,
    TimmEvalDecoder,
    ViewLabelDecoder,
    handover_bytes,
    unpack_views,
)
from .ffcv_epoch import EpochIterator
from .geometry import EpochGeometry, LoaderSpec
from .order import view_seeds
from .private_aug import PrivateAugment

HANDOVER_BUDGET_BYTES = 8 * 2**30
"""The most a rank's FFCV loader may hold for handing views over (``FfcvLoader._handover``): its slots, each packing
one batch's views."""


def subset_indices(manifest: Manifest, split: str, fraction: float, fields: tuple[str, str] = FFCV_FIELDS,
                   num_classes: int | None = None) -> tuple[Path, np.ndarray]:
    """The FFCV file of ``split`` and the sample indices of its Table 2 subset: the first floor(n_c * f) samples of
    each class in file order (``prep ffcv`` writes sorted (class, file) order: the first files of each class), from
    the file's label column; with ``num_classes``, of the first classes only."""
    info = manifest.split(split)
    manifest.require_whole(fraction)
    (name,) = info.files
    path = manifest.folder / name
    if fraction >= 1.0 and num_classes is None:
        return path, np.arange(info.num_samples)
    labels = info.labels if info.labels is not None else read_ffcv_labels(path, fields)
    order = np.argsort(labels, kind="stable")  # each class's samples, in file order
    starts = np.concatenate([[0], np.cumsum(np.bincount(labels))])
    classes = len(starts) - 1 if num_classes is None else min(num_classes, len(starts) - 1)
    keep = [order[s:s + math.floor((e - s) * fraction)] for s, e in zip(starts[:classes], starts[1:classes + 1])]
    return path, np.sort(np.concatenate(keep))


class FfcvLoader:
    """FFCV .beton through ffcv's Loader with the epoch plan as its traversal order.

    Train crops, flips and the timm augmentation that follows are drawn from the view's seed, a function
    of (seed, epoch, position in the epoch): the same batches for any ``num_workers`` and after a resume.
    """

    def __init__(self, d: DataConfig, spec: LoaderSpec):
        location = d.train_path if spec.train else d.val_path
        manifest = Manifest.read(location, d.ffcv_fields)
        self._path, indices = subset_indices(manifest, spec.split, d.subset_fraction if spec.train else 1.0,
                                             d.ffcv_fields, d.num_classes)
        self.num_samples = len(indices)
        self.d, self.spec, self._indices = d, spec, indices.astype(np.uint64)
        self.geometry = EpochGeometry.of(self.num_samples, spec, str(location))
        self.num_real = self.geometry.num_real
        self._loader = None
        self.handover = self._handover(d, spec) if spec.train else "pixels"

    def __len__(self) -> int:
        return self.geometry.num_batches

    def _handover(self, d: DataConfig, spec: LoaderSpec) -> str:
        """``spec.handover``, where ffcv's buffers for it fit ``HANDOVER_BUDGET_BYTES``: each of the epoch's slots
        packs its batch's views (``ffcv_decoders._HandoverDecoder``), sized for the largest batch of the first
        epoch (``handover_bytes``) with ``ARENA_MARGIN``. A .beton whose batches of boxes would not fit resizes on
        the CPU under ``resize_on: auto`` (said once), and is refused where the recipe asks for the hand-over."""
        if spec.handover == "pixels":
            return "pixels"
        self._arena = self._arena_bytes(spec.handover, self.views(0))
        workers = max(1, d.num_workers)
        slots = (max(1, -(-3 // workers)) + 1) * workers + 1  # EpochIterator's, at ffcv's batches_ahead = 3
        need = self._arena * slots
        if need <= HANDOVER_BUDGET_BYTES:
            return spec.handover
        why = (f"{self._path}: handing views over to the device needs {need / 2**30:.1f} GiB of loader buffers per "
               f"rank ({slots} slots x {self._arena / 2**20:.1f} MiB, the largest batch of {spec.micro_batch_size} "
               f"views' {'crop boxes' if spec.handover == 'box' else 'files'} in the first epoch), over "
               f"{HANDOVER_BUDGET_BYTES / 2**30:.0f} GiB")
        if d.resize_on == "auto" and d.decode_on == "cpu":
            if spec.rank == 0:
                print(f"[convit-scale] {why}: the crops are resized on the CPU (convert with `convit-scale prep ffcv "
                      f"--max-resolution 512` to hand them over)", flush=True)
            return "pixels"
        raise DataError(f"{why}; convert with `convit-scale prep ffcv --max-resolution 512`, or data.resize_on=cpu")

    def _arena_bytes(self, kind: str, views: np.ndarray) -> int:
        """A slot's arena for ``views`` (an epoch's, in order): their largest batch with ``ARENA_MARGIN``."""
        largest = handover_bytes(kind, Reader(str(self._path)), self.d.ffcv_fields[0], views,
                                 self.spec.micro_batch_size, self.d.crop_scale)
        return int(largest * ARENA_MARGIN)

    def _image_pipeline(self) -> list:
        d, size, on_device = self.d, self.spec.img_size, self.spec.augment_on_device
        if not self.spec.train:
            return [TimmEvalDecoder((size, size), d.eval_crop_ratio, d.interpolation), ToTensor(),
                    ToTorchImage(channels_last=False)] + ([] if on_device else [EvalNormalize()])
        if self.handover != "pixels":  # the box at its own size and the flip (the training device resizes), or the
            # file's bytes, the box and the flip (the training device decodes), packed into the slot's arena
            decoder = SeededBoxDecoder if self.handover == "box" else SeededJpegDecoder
            self._packer = decoder(d.hflip, d.crop_scale, self.spec.group_size, self._arena)
            return [self._packer, ToTensor()]
        crop = SeededCropFlipDecoder((size, size), d.hflip, d.crop_scale, d.interpolation, self.spec.group_size)
        if on_device:  # uint8 crops, channels-last (also where the hand-over does not fit); the device augments
            return [crop, ToTensor(), ToTorchImage()]

        _, secondary, final = create_transform(
            input_size=size, is_training=True, hflip=0.0, color_jitter=d.color_jitter,
            auto_augment=d.rand_augment, interpolation=d.interpolation, re_prob=d.reprob,
            re_mode="pixel", re_count=1, separate=True)
        return [crop, PrivateTimmStage(PrivateAugment(secondary, final), size)]

    def _pipelines(self) -> dict:
        """The image and label fields' pipelines (``data.ffcv_fields``); the file's other fields are not read."""
        image, label = self.d.ffcv_fields
        others = {name: None for name in Reader(str(self._path)).field_names if name not in (image, label)}
        return {image: self._image_pipeline(), label: [ViewLabelDecoder(), ToTensor(), Squeeze()], **others}

    def ffcv_loader(self) -> Loader:
        """ffcv's Loader of this split, with its compiled pipelines (``ffcv_decoders.py``) and buffers: built once
        (ffcv compiles the pipelines with numba: seconds). Its order is never used: ``epoch`` hands each epoch's views
        (``views``) to ``EpochIterator`` itself; ``bench data`` runs its stages on threads of its own."""
        if self._loader is None:
            self._loader = Loader(
                str(self._path), batch_size=self.spec.micro_batch_size, num_workers=max(1, self.d.num_workers),
                order=OrderOption.SEQUENTIAL, indices=self._indices, seed=self.spec.seed, drop_last=self.spec.train,
                os_cache=True, pipelines=self._pipelines())
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
        loader = self.ffcv_loader()
        order = self.views(epoch, start_batch)
        if self.spec.train:  # whole micro-batches only (the decoder marks replaced views in this array's memory)
            order = order[:len(order) // loader.batch_size * loader.batch_size]
        if self.handover != "pixels" and handover_bytes(self.handover, loader.reader, self.d.ffcv_fields[0], order,
                                                        loader.batch_size, self.d.crop_scale) > self._packer.arena:
            self._packer.arena = self._arena_bytes(self.handover, order)  # this epoch's boxes: slots made again
            loader.epoch_buffers = (0, None)
        it = EpochIterator(loader, order)
        try:
            yield from limit_bad_samples(self._batches(it, order), self.d.max_bad_samples, epoch, self.spec.rank)
        finally:
            it.close()

    def _batches(self, it, order: np.ndarray):
        first = 0
        for out in it:  # the fields' outputs in the file's field order: the images are the 4-d one
            images, labels = out if out[0].dim() > out[1].dim() else out[::-1]
            # ffcv reuses its output buffers: copy what leaves the loader. In device-augmentation mode the images
            # stay channels-last (NCHW over the decoder's NHWC memory): a plain copy here, and the transposition
            # happens on the training device (device_augment), not in this thread, which every batch passes through.
            # With pinning, the one copy goes straight into page-locked memory (clone, then pin, would be two).
            if self.handover != "pixels":  # packed in the slot's arena (ffcv's buffer): copied out
                images = unpack_views(images, len(labels), self.handover, self.spec.pin_memory)
            else:
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
