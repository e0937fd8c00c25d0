"""The DeiT recipe's transforms (the paper's Section 3), built with timm so every loader shares them.

Train: bicubic RandomResizedCrop + flip, RandAugment rand-m9-mstd0.5-inc1, colour jitter 0.4 (timm skips
it when RandAugment is on, as DeiT does), normalisation, random erasing 0.25 in pixel mode.
Eval: resize to img_size / 0.875 (256 for 224), centre crop, normalisation.
Mixup 0.8 / CutMix 1.0 with label smoothing act on the canonical groups of a batch in the training step (mixup.py).

With the augmentation on the training device (``LoaderSpec.augment_on_device``) the loaders stop at uint8
tensors: train after the crop and flip, eval after the resize and centre crop; device_augment.py does the rest.

The train transform's crop takes a JPEG opened but not decoded (``faults.UndecodedJpeg``) too, and then decodes only
its box (``CropDecodingResizedCrop``): the same box and pixels as timm's crop of the decoded image.
"""

from __future__ import annotations

import random

import numpy as np
import torch
from PIL import Image
from timm.data import IMAGENET_DEFAULT_MEAN, IMAGENET_DEFAULT_STD, create_transform
from timm.data.transforms import MaybePILToTensor, RandomResizedCropAndInterpolation
from torchvision.transforms import Compose, RandomHorizontalFlip
from torchvision.transforms import functional as F

from .. import jpeg_roi
from ..config import DataConfig
from .batch import Encoded
from .faults import DECODE_ERRORS, CropDecodeError, UndecodedJpeg, open_jpeg_or_decode, pil_rgb
from .sample import compile_draws, crop_box, flipped


class CropDecodingResizedCrop(RandomResizedCropAndInterpolation):
    """timm's RandomResizedCropAndInterpolation with the box of the view's seed (``sample.crop_box``: the box every
    loader draws for that view; ``seed`` is set per view by ``TrainView``), that also takes an ``UndecodedJpeg``: the
    box drawn from its header's size, only the box decoded (``jpeg_roi``: PIL's pixels, bit for bit), then resized as
    timm's ``F.resized_crop`` resizes the crop. Where the crop-region decoder is missing or refuses the JPEG (CMYK,
    corrupt data inside the box), PIL decodes the whole image, as before; a failure then is a ``CropDecodeError`` (the
    loader replaces the sample). A JPEG corrupt only below its box is not read that far: it trains (the whole decode
    would have refused it)."""

    seed = 0

    @classmethod
    def of(cls, crop: RandomResizedCropAndInterpolation) -> "CropDecodingResizedCrop":
        """The same crop (size, scale, ratio, interpolation as timm built them)."""
        new = cls.__new__(cls)
        new.__dict__.update(crop.__dict__)
        return new

    def get_params(self, img, scale, ratio):
        return crop_box(img.size[1], img.size[0], self.seed, scale, ratio)

    def __call__(self, img):
        if not isinstance(img, UndecodedJpeg):
            return super().__call__(img)
        i, j, h, w = self.get_params(img.header, self.scale, self.ratio)
        interpolation = self.interpolation
        if isinstance(interpolation, (tuple, list)):
            interpolation = random.choice(interpolation)
        box = jpeg_roi.decode_box(img.data, i, j, h, w)
        if box is not None:
            return F.resized_crop(Image.fromarray(box), 0, 0, h, w, self.size, interpolation)
        try:
            whole = img.header.convert("RGB")
        except DECODE_ERRORS as e:
            raise CropDecodeError() from e
        return F.resized_crop(whole, i, j, h, w, self.size, interpolation)


class SeededFlip:
    """The horizontal flip of the view's seed (``sample.flipped``), in place of torchvision's RandomHorizontalFlip."""

    seed = 0

    def __init__(self, p: float):
        self.p = p

    def __call__(self, img):
        return F.hflip(img) if flipped(np.uint64(self.seed), self.p) else img


class BoxCrop:
    """The train view's RandomResizedCrop box at its own size and its flip, for the training device to resize
    (``data.resize_on: device``): ``(uint8 (h, w, 3) array, flip)``, the box and the flip of the view's seed as every
    loader draws them (``sample.py``); a JPEG's box alone is decoded (``jpeg_roi``), as ``CropDecodingResizedCrop``
    decodes it."""

    def __init__(self, crop: RandomResizedCropAndInterpolation, hflip: float):
        self.scale, self.ratio, self.hflip = tuple(crop.scale), tuple(crop.ratio), hflip

    def box(self, img, seed: int) -> tuple:
        """(i, j, h, w) of ``img`` (a decoded image or an ``UndecodedJpeg``) and the flip, of the view ``seed``."""
        header = img.header if isinstance(img, UndecodedJpeg) else img
        box = crop_box(header.size[1], header.size[0], seed, self.scale, self.ratio)
        return box, bool(flipped(np.uint64(seed), self.hflip))

    def __call__(self, img, seed: int):
        (i, j, h, w), flip = self.box(img, seed)
        if isinstance(img, UndecodedJpeg):
            box = jpeg_roi.decode_box(img.data, i, j, h, w)
            if box is not None:
                return box, flip
            try:
                img = img.header.convert("RGB")
            except DECODE_ERRORS as e:
                raise CropDecodeError() from e
        return np.asarray(img.convert("RGB"))[i:i + h, j:j + w], flip


class JpegView(BoxCrop):
    """The train view undecoded, for the training device to decode, crop, resize and flip (``data.decode_on:
    device``): ``(payload, kind, (height, width), (i, j, h, w), flip)`` (``batch.Encoded``), the box and flip drawn as
    ``BoxCrop`` draws them. A JPEG is handed over as its bytes; an image that is not one, decoded here."""

    def __call__(self, img, seed: int):
        box, flip = self.box(img, seed)
        if isinstance(img, UndecodedJpeg):
            return img.data, Encoded.JPEG, (img.header.height, img.header.width), box, flip
        pixels = np.asarray(img.convert("RGB"))
        return pixels, Encoded.RAW, pixels.shape[:2], box, flip


class TrainView:
    """A train transform called per view as ``transform(img, seed)``: the host generators seeded by the view's seed
    (``seed_host``: what timm's augmentation after the crop draws from), the crop and flip given the seed."""

    def __init__(self, transform: Compose):
        self.compose = transform
        self.seeded = [t for t in transform.transforms if isinstance(t, (CropDecodingResizedCrop, SeededFlip))]

    @property
    def transforms(self) -> list:
        return self.compose.transforms

    def __call__(self, img, seed: int):
        seed_host(seed)
        for t in self.seeded:
            t.seed = seed
        return self.compose(img)


def _crop_decoding(transform: Compose) -> TrainView:
    """``transform`` with timm's random resized crop taking undecoded JPEGs too and both it and the flip drawing from
    the view's seed (``sample.py``), called per view (``TrainView``)."""
    if type(transform.transforms[0]) is not RandomResizedCropAndInterpolation:
        raise TypeError(f"timm's train transform starts with {transform.transforms[0]!r}, not its resized crop")
    transform.transforms[0] = CropDecodingResizedCrop.of(transform.transforms[0])
    transform.transforms = [SeededFlip(t.p) if isinstance(t, RandomHorizontalFlip) else t for t in transform.transforms]
    return TrainView(transform)


def image_opener(transform):
    """How a loader opens an image for ``transform``: a JPEG's header only when the transform's crop decodes its box
    alone (the train transform, with jpeg_roi's library: else said once), anything else decoded whole."""
    first = getattr(transform, "transforms", [transform])[0]
    if isinstance(first, JpegView):  # the device decodes: the header alone, whatever the crop decoder
        return open_jpeg_or_decode
    if isinstance(first, (CropDecodingResizedCrop, BoxCrop)) and jpeg_roi.warn_if_missing("the WebDataset train "
                                                                                            "loader"):
        return open_jpeg_or_decode
    return pil_rgb


def build_train_transform(d: DataConfig, img_size: int, on_device: bool = False, handover: str = "pixels"):
    """The whole train transform, or (``on_device``) its crop and flip only, to a uint8 (3, S, S) tensor. Its crop
    takes a decoded image or an ``UndecodedJpeg`` (``CropDecodingResizedCrop``). ``handover`` (``LoaderSpec``): "box"
    stops at the crop box (``BoxCrop``), "jpeg" before decoding (``JpegView``)."""
    compile_draws()
    if handover != "pixels":
        primary, _, _ = create_transform(input_size=img_size, is_training=True, scale=tuple(d.crop_scale),
                                         hflip=d.hflip, interpolation=d.interpolation, separate=True)
        return (BoxCrop if handover == "box" else JpegView)(primary.transforms[0], d.hflip)
    if on_device:
        primary, _, _ = create_transform(input_size=img_size, is_training=True, scale=tuple(d.crop_scale),
                                         hflip=d.hflip, interpolation=d.interpolation, separate=True)
        return _crop_decoding(Compose([*primary.transforms, MaybePILToTensor()]))
    return _crop_decoding(create_transform(
        input_size=img_size, is_training=True, scale=tuple(d.crop_scale), hflip=d.hflip,
        color_jitter=d.color_jitter, auto_augment=d.rand_augment, interpolation=d.interpolation,
        re_prob=d.reprob, re_mode="pixel", re_count=1,
    ))


def build_eval_transform(d: DataConfig, img_size: int, on_device: bool = False):
    """Resize, centre crop, normalise; or (``on_device``) a uint8 (3, S, S) tensor, normalised on the device."""
    return create_transform(input_size=img_size, is_training=False, interpolation=d.interpolation,
                            crop_pct=d.eval_crop_ratio, use_prefetcher=on_device)


def transform_view(transform, img, seed: int):
    """``transform`` of one view: a train transform given the view's seed (``TrainView``, ``BoxCrop``), any other
    after the host generators are seeded with it."""
    if isinstance(transform, (TrainView, BoxCrop)):
        return transform(img, seed)
    seed_host(seed)
    return transform(img)


def seed_host(seed: int) -> None:
    """Seed Python, NumPy and torch's CPU generator: what timm's per-sample transforms draw from. The loaders call
    it once per sample; ``torch.manual_seed`` would also reseed every accelerator (each call formats a stack trace
    for the lazily initialised ones, ~50x the cost), and in a loader on the training thread it would reset the
    generator that drop-path draws from on the GPU."""
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.default_generator.manual_seed(seed)


def seed_all(seed: int) -> None:
    """Seed Python, NumPy and torch on every device (the training step seeds them with its own seed, the same on every
    rank: its Mixup and drop-path draw from the groups' and samples' seeds, nothing of it from these)."""
    seed_host(seed)
    torch.manual_seed(seed)


MEAN, STD = IMAGENET_DEFAULT_MEAN, IMAGENET_DEFAULT_STD
