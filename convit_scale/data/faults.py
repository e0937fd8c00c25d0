"""What the loaders share for samples that cannot be read: the decode, the replacement rule and the epoch's limit.

A 300-epoch ImageNet run decodes ~400M JPEGs from ~400,000 shard opens: one corrupt file or one truncated
member must not kill a rank. Such a sample is replaced by a rule that depends only on the epoch's data (the
same replacement on a rerun and after a resume), listed in ``Batch.bad`` as ``{"shard" or "file", "key",
"reason"}`` and counted; more than ``data.max_bad_samples`` in one epoch on one rank stops the run with a
DataError naming the last shard or file and the limit.
"""

from __future__ import annotations

import io
from typing import NamedTuple

from PIL import Image, UnidentifiedImageError

from ..manifest import DataError, SourceUnavailable

STREAM_BROKE = "the stream broke off"
"""How the samples begin their reason that a remote shard (``pipe:`` or a URL) never delivered after its retries
(``shards.py``): its source failed, not, as far as can be told, its data."""

DECODE_ERRORS = (OSError, ValueError, SyntaxError, EOFError, Image.DecompressionBombError)
"""What PIL raises for bytes that are not a readable image (truncated, corrupt, not an image at all)."""


def pil_rgb(data: bytes) -> Image.Image:
    """The RGB image in ``data``, fully decoded (PIL opens lazily: ``convert`` reads every byte)."""
    try:
        return Image.open(io.BytesIO(data)).convert("RGB")
    except UnidentifiedImageError:  # its message names the buffer's address: the same reason on every run
        raise UnidentifiedImageError("cannot identify image data") from None


class UndecodedJpeg(NamedTuple):
    """A JPEG opened but not decoded, for a train transform that decodes only its crop box (``transforms.py``)."""

    data: bytes
    header: Image.Image
    """PIL's image of ``data`` with only its header read: its size, from which the box is drawn."""


class CropDecodeError(Exception):
    """An ``UndecodedJpeg`` that failed when its crop was decoded: its ``__cause__`` is what PIL raised."""


def open_jpeg_or_decode(data: bytes) -> Image.Image | UndecodedJpeg:
    """A JPEG's header only (an ``UndecodedJpeg``), else the image decoded in RGB (``pil_rgb``). Bytes that are no
    image at all are refused here, as by ``pil_rgb``; a JPEG's corrupt data only when its crop is decoded."""
    try:
        header = Image.open(io.BytesIO(data))
    except UnidentifiedImageError:
        raise UnidentifiedImageError("cannot identify image data") from None
    if header.format == "JPEG" and header.mode in ("RGB", "L"):
        return UndecodedJpeg(data, header)
    return header.convert("RGB")


def reason_of(e: BaseException) -> str:
    return f"{type(e).__name__}: {e}".replace("\n", " ")


def next_good(failed, i: int, n: int) -> int | None:
    """The first index after ``i`` (cyclically, among ``n``) that is not in ``failed``: the replacement of ``i``."""
    for j in range(i + 1, i + n):
        if j % n not in failed:
            return j % n
    return None


def limit_bad_samples(batches, limit: int, epoch: int, rank: int):
    """Yield ``batches``, counting their ``bad`` samples; a DataError once the epoch's count on this rank passes
    ``limit`` (``SourceUnavailable`` where most of them are samples of remote shards whose stream broke off,
    ``STREAM_BROKE``: a store that is down, which a restart may find back). After a resume the count starts at the
    resume point (earlier batches are skipped unread)."""
    count = broke = 0
    for batch in batches:
        count += len(batch.bad)
        broke += sum(1 for r in batch.bad if str(r.get("reason", "")).startswith(STREAM_BROKE))
        if count > limit:
            last = batch.bad[-1]
            where = last.get("shard", last.get("file"))
            error = SourceUnavailable if 2 * broke > count else DataError
            raise error(f"{where}: {count} unreadable samples in epoch {epoch} on rank {rank}, more than "
                        f"data.max_bad_samples = {limit} (last: key {last['key']}: {last['reason']})")
        yield batch
