"""WebDataset shards as streams of samples: a local folder or any URL webdataset opens (``pipe:``, http), a shard
read with retries (``data.open_retries``; a ``pipe:`` command's exit status counting), and webdataset's bounded
shuffle buffer. The shards' manifest is ``manifest.py``'s."""

from __future__ import annotations

import shlex
import subprocess
import tarfile
import tempfile
import time
from pathlib import Path

import numpy as np
from webdataset.gopen import gopen

from ..manifest import read_label
from .faults import DataError, reason_of


def shard_url(location: str, name: str) -> str:
    """The URL or path of shard ``name`` at ``location`` (what errors and ``Batch.bad`` name)."""
    return location.format(name=name) if "{name}" in location else str(Path(location) / name)


class _CommandStream:
    """The standard output of a shell command (a ``pipe:`` URL, or curl for http(s)), whose exit status and
    standard error are checked: a command that fails is a failed read even when its output looks complete."""

    def __init__(self, command: str):
        self.command, self.stderr = command, tempfile.TemporaryFile()  # a file: a chatty command never blocks
        self.proc = subprocess.Popen(command, shell=True, stdout=subprocess.PIPE, stderr=self.stderr)

    def read(self, size: int = -1) -> bytes:
        return self.proc.stdout.read(size)

    def failure(self, wait: bool = False) -> str | None:
        """"exit status N: <last line of stderr>" once the command has failed, else None."""
        status = self.proc.wait() if wait else self.proc.poll()
        if not status:
            return None
        self.stderr.seek(0)
        lines = [line.strip() for line in self.stderr.read()[-2000:].decode(errors="replace").splitlines()]
        last = next((line for line in reversed(lines) if line), "")
        return f"exit status {status}" + (f": {last}" if last else "")

    def finish(self) -> None:
        """At the end of the archive: read what is left, wait, and raise OSError if the command failed."""
        while self.proc.stdout.read(1 << 16):
            pass
        failure = self.failure(wait=True)
        if failure:
            raise OSError(failure)

    def close(self) -> None:
        if self.proc.poll() is None:  # left early (the range ended inside the shard): not a failure
            self.proc.kill()
        self.proc.stdout.close()
        self.proc.wait()
        self.stderr.close()


def _open_stream(url: str):
    if url.startswith("pipe:"):
        return _CommandStream(url[len("pipe:"):])
    if url.startswith(("http://", "https://")):
        return _CommandStream(f"curl -fsS -L --connect-timeout 30 {shlex.quote(url)}")
    if "://" in url:
        return gopen(url, "rb")
    return open(url, "rb")


def _tar_samples(tar, where: list, label: str = "cls"):
    """(key, jpg, label, reason) of each sample of an open tar stream, in order; ``where[0]`` holds the key being
    read. The label is the ``.cls`` member, or with ``label="json:FIELD"`` that field of the ``.json`` member
    (``Manifest.label_member``). A sample without both members or with an unreadable label comes with a reason
    instead of data. Other members of a sample (timm's ``.json`` sidecar, before or after the two) are read past."""
    key, jpg, cls, given = None, None, None, None
    label_ext, _, field = label.partition(":")  # the field: named in a refusal

    def sample():
        if jpg is None or cls is None:
            return key, None, None, f"incomplete sample (no .{'jpg' if jpg is None else label_ext} member)"
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
            key, jpg, cls = stem, None, None
            where[0] = key
        payload = tar.extractfile(member).read()
        if len(payload) != member.size:
            raise tarfile.ReadError(f"member {member.name} truncated")
        if ext == "jpg":
            jpg = payload
        elif ext == label_ext:
            cls = payload
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
    valid tar reads the same again and is not reopened. When it never opens: a DataError naming the shard and
    the number of tries. When it keeps failing mid-shard: the rest of its samples come with the reason."""
    url = shard_url(location, name)
    local = "{name}" not in location
    delivered, tries, where = 0, 0, [None]
    while delivered < count:
        tries += 1
        opened, stream = False, None
        try:
            stream = _open_stream(url)
            with tarfile.open(fileobj=stream, mode="r|") as tar:
                opened, position = True, 0
                for item in _tar_samples(tar, where, label):
                    if position >= delivered:
                        yield item
                        delivered += 1
                    position += 1
                    if delivered == count:
                        break
            if delivered < count and isinstance(stream, _CommandStream):
                stream.finish()
            if delivered < count:
                raise tarfile.ReadError(f"the shard ends after {delivered} of {count} samples")
        except (OSError, tarfile.TarError, EOFError) as e:
            failure = stream.failure(wait=True) if isinstance(stream, _CommandStream) else None
            reason = failure or reason_of(e)
            if tries <= retries and not (local and isinstance(e, (tarfile.TarError, EOFError))):
                sleep(backoff_s * 2 ** (tries - 1))
                continue
            if not opened and delivered == 0:
                raise DataError(f"{url}: could not be opened after {tries} tr{'y' if tries == 1 else 'ies'} "
                                f"({reason}); data.open_retries = {retries}") from e
            why = f"truncated or corrupt shard after {tries} tr{'y' if tries == 1 else 'ies'} ({reason})"
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
