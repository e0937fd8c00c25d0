"""What a conversion is asked for (``PrepOptions``) and the options' allowed ranges, checked before anything is
read or written."""

from __future__ import annotations

import os
from dataclasses import dataclass

from convit_scale.imagetree import PrepError


@dataclass
class PrepOptions:
    fmt: str = "wds"
    """'wds' (tar shards of the original JPEG bytes) or 'ffcv' (.beton)."""
    splits: tuple[str, ...] = ("train", "val")
    subset_fraction: float = 1.0
    """Table 2: keep the first floor(n_c * f) train files per class (sorted)."""
    shard_size: int = 1000
    """wds: samples per shard (shards differ by at most one sample)."""
    seed: int = 0
    """wds: the shuffle before sharding (ImageFolder order is by class)."""
    num_classes: int | None = None
    """Keep only the first N classes (sorted folder names), train and val: the appendix's 100-class experiments (the
    official code's ``--nb_classes``); None keeps every class."""
    write_mode: str = "keep"
    """ffcv: 'keep' stores each source JPEG's own bytes where the loader's decoder gives PIL's pixels from them (every
    ImageNet JPEG but the CMYK ones), the other images (CMYK, PNG named .JPEG, a JPEG turbojpeg warns about) as PIL's
    RGB pixels, raw; 'jpg', 'raw', 'proportion', 'smart' are ffcv's own modes, every image decoded and written by
    ffcv ('jpg': every image re-encoded at ``jpeg_quality``, the earlier default, with a 384-pixel max side)."""
    max_resolution: int | None = None
    """ffcv: shrink images whose longer side exceeds this (ffcv's INTER_AREA resize); with 'keep' those images are
    re-encoded at ``jpeg_quality``, the others kept. None keeps every image at its size, as timm's loaders see it."""
    jpeg_quality: int = 90
    """ffcv: the quality of the JPEGs prep encodes ('jpg', 'proportion', 'smart', and with 'keep' the resized
    images); kept JPEGs keep their own."""
    strict: bool = False
    """Fail instead of skipping unreadable files."""
    workers: int = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    val_labels: str | None = None
    val_synsets: str | None = None
    image_column: str = "image"
    """Parquet sources: the column of the images' bytes (or of {bytes, path} structs)."""
    label_column: str = "label"
    """Parquet sources: the column of the integer labels."""


WRITE_MODES = ("keep", "jpg", "raw", "proportion", "smart")


def check_options(opts: PrepOptions) -> None:
    """The options' ranges (the command line checks them too; library callers get the same one line)."""
    checks = [
        ("format", opts.fmt, opts.fmt in ("wds", "ffcv"), "wds or ffcv"),
        ("--subset-fraction", opts.subset_fraction, 0 < opts.subset_fraction <= 1, "in (0, 1]"),
        ("--jpeg-quality", opts.jpeg_quality, 1 <= opts.jpeg_quality <= 100, "in 1..100"),
        ("--shard-size", opts.shard_size, opts.shard_size >= 1, ">= 1"),
        ("--max-resolution", opts.max_resolution, opts.max_resolution is None or opts.max_resolution >= 1, ">= 1"),
        ("--num-classes", opts.num_classes, opts.num_classes is None or opts.num_classes >= 1, ">= 1"),
        ("--workers", opts.workers, opts.workers >= 1, ">= 1"),
        ("--write-mode", opts.write_mode, opts.write_mode in WRITE_MODES, "one of " + ", ".join(WRITE_MODES)),
    ]
    for name, value, ok, allowed in checks:
        if not ok:
            raise PrepError(f"prep {name} {value!r} is not allowed: must be {allowed}")
