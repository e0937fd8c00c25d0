"""WebDataset shards as streams of samples: a local folder or any URL webdataset opens (``pipe:``, http), a shard
read with retries (``data.open_retries``; a ``pipe:`` command's exit status counting), and webdataset's bounded
shuffle buffer. The shards' manifest is ``manifest.py``'s."""

from __future__ import annotations

import tarfile
import time

import numpy as np

from ..manifest import DataError, SourceUnavailable, read_label
from ..streams import CommandStream, open_stream, shard_url
from .faults import STREAM_BROKE, reason_of


def _tar_samples(tar, where: list, label: str = "cls"):
    """(key, jpg, label, reason) of each sample of an open tar stream, in order; ``where[0]`` holds the key being
    read. The label is the ``.cls`` member, or with ``label="json:FIELD"`` that field of the ``.json`` member
    (``Manifest.label_member``). A sample without both members or with an unreadable label comes with a reason
    instead of data (one without ``.cls`` but with a ``.json`` member names ``prep index --label json:FIELD``, which
    reads the label there). Other members of a sample (timm's ``.json`` sidecar, before or after the two) are read
    past."""
    key, jpg, cls, given, has_json = None, None, None, None, False
    label_ext, _, field = label.partition(":")  # the field: named in a refusal

    def sample():
        if jpg is None or cls is None:
            missing = "jpg" if jpg is None else label_ext
            fix = ("; if the labels are in KEY.json, describe the shards with `convit-scale prep index SRC --label "
                   "json:FIELD --out DIR` and train from DIR" if missing == "cls" and has_json else "")
            return key, None, None, f"incomplete sample (no .{missing} member{fix})"
        try:
            return key, jpg, read_label(cls, label), None
        except (ValueError, KeyError, TypeError):
            return key, None, None, f"unreadable label {cls[:40]!r}" + (f" (field {field!r})" if field else "")

    for member in tar:
        stem, _, ext = member.name.rpartition(".")
        if stem == given:  # a member of the sample just yielded
            continue
        if stem != key:
            if key is not None:
                yield sample()
            key, jpg, cls, has_json = stem, None, None, False
            where[0] = key
        payload = tar.extractfile(member).read()
        if len(payload) != member.size:
            raise tarfile.ReadError(f"member {member.name} truncated")
        if ext == "jpg":
            jpg = payload
        elif ext == label_ext:
            cls = payload
        has_json = has_json or ext == "json"
        if jpg is not None and cls is not None:
            yield sample()
            key, jpg, cls, given = None, None, None, stem
    if key is not None:
        yield sample()


def shard_samples(location: str, name: str, count: int, retries: int, backoff_s: float, sleep=time.sleep,
                  label: str = "cls"):
    """The ``count`` samples of one shard, in order, as (key, jpg, label, reason); ``reason`` (else None) says
    why a sample has no data. A shard that fails to open or to stream is reopened after backoff_s, 2 x
    backoff_s, ... (``retries`` times), skipping the samples already delivered; a local file that is not a
    valid tar reads the same again and is not reopened. When it never opens: ``SourceUnavailable`` (a DataError)
    naming the shard and the number of tries (a plain ``DataError`` for a local file that is no tar). When it keeps
    failing mid-shard: the rest of its samples come with the reason (``STREAM_BROKE`` where a remote shard's
    transport failed: its command's non-zero exit, or an I/O error)."""
    url = shard_url(location, name)
    local = "{name}" not in location
    delivered, tries, where = 0, 0, [None]
    while delivered < count:
        tries += 1
        opened, stream = False, None
        try:
            stream = open_stream(url)
            with tarfile.open(fileobj=stream, mode="r|") as tar:
                opened, position = True, 0
                for item in _tar_samples(tar, where, label):
                    if position >= delivered:
                        yield item
                        delivered += 1
                    position += 1
                    if delivered == count:
                        break
            if delivered < count and isinstance(stream, CommandStream):
                stream.finish()
            if delivered < count:
                raise tarfile.ReadError(f"the shard ends after {delivered} of {count} samples")
        except (OSError, tarfile.TarError, EOFError) as e:
            failure = stream.failure(wait=True) if isinstance(stream, CommandStream) else None
            reason = failure or reason_of(e)
            bytes_fault = isinstance(e, (tarfile.TarError, EOFError)) and failure is None  # not their transport
            if tries <= retries and not (local and bytes_fault):
                sleep(backoff_s * 2 ** (tries - 1))
                continue
            if not opened and delivered == 0:  # a local file that is no tar is bad data; a store may come back
                raise (DataError if local and bytes_fault else SourceUnavailable)(
                    f"{url}: could not be opened after {tries} tr{'y' if tries == 1 else 'ies'} ({reason}); "
                    f"data.open_retries = {retries}") from e
            what = "truncated or corrupt shard" if local or bytes_fault else STREAM_BROKE
            why = f"{what} after {tries} tr{'y' if tries == 1 else 'ies'} ({reason})"
            for off in range(delivered, count):
                yield (where[0] if off == delivered and where[0] is not None else f"#{off}"), None, None, why
            return
        finally:
            if stream is not None:
                stream.close()


def shuffle_buffer(items, size: int, rng: np.random.Generator):
    """webdataset's shuffle: fill a buffer, emit a random element, refill (bounded memory)."""
    buf = []
    for item in items:
        buf.append(item)
        if len(buf) >= size:
            k = int(rng.integers(len(buf)))
            buf[k], buf[-1] = buf[-1], buf[k]
            yield buf.pop()
    while buf:
        k = int(rng.integers(len(buf)))
        buf[k], buf[-1] = buf[-1], buf[k]
        yield buf.pop()
