"""WebDataset shards from ``data_prep`` (local folders or any URL webdataset opens: ``pipe:``, http).

Shards are read in a per-epoch permuted order; each rank reads its contiguous range of the sample
sequence through DataLoader workers, and augmentation is seeded per sample, so a resumed epoch is
bit-identical. A shard that fails to open or to stream is reopened with backoff (``data.open_retries``), a
``pipe:`` command's exit status counting; a sample that cannot be read or decoded is replaced and listed
(faults.py).
"""

from __future__ import annotations

import json
import math
import shlex
import subprocess
import tarfile
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
from torch.utils.data import DataLoader, IterableDataset, get_worker_info
from webdataset.gopen import gopen

from ..config import DataConfig
from .batch import Batch
from .faults import DECODE_ERRORS, DataError, decode_rgb, limit_bad_samples, next_good, reason_of
from .geometry import EpochGeometry, LoaderSpec, eval_positions
from .order import contiguous_range, epoch_permutation, view_seeds
from .transforms import build_eval_transform, build_train_transform, seed_host
from .workers import iterate, loader_options


def _open(location: str, name: str):
    """Open a file next to ``location``: a local folder, or a URL template with ``{name}``
    (``pipe:aws s3 cp s3://bucket/imagenet/{name} -``, ``https://host/shards/{name}``)."""

    if "{name}" in location:
        return gopen(location.format(name=name), "rb")
    path = Path(location) / name
    if not path.is_file():
        raise DataError(f"{path}: not found")
    return open(path, "rb")


def read_manifest(location: str) -> dict:
    try:
        with _open(location, "manifest.json") as f:
            return json.loads(f.read())
    except (OSError, ValueError) as e:
        raise DataError(f"{location}: no readable manifest.json ({e}); convert with `convit-scale prep`") from e


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


def _tar_samples(tar, where: list):
    """(key, jpg, label, reason) of each sample of an open tar stream, in order; ``where[0]`` holds the key being
    read. A sample without both members or with an unreadable label comes with a reason instead of data."""
    key, jpg, cls = None, None, None

    def sample():
        if jpg is None or cls is None:
            return key, None, None, f"incomplete sample (no .{'jpg' if jpg is None else 'cls'} member)"
        try:
            return key, jpg, int(cls), None
        except ValueError:
            return key, None, None, f"unreadable label {cls[:20]!r}"

    for member in tar:
        stem, _, ext = member.name.rpartition(".")
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
        elif ext == "cls":
            cls = payload
        if jpg is not None and cls is not None:
            yield sample()
            key, jpg, cls = None, None, None
    if key is not None:
        yield sample()


def shard_samples(location: str, name: str, count: int, retries: int, backoff_s: float, sleep=time.sleep):
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
                for item in _tar_samples(tar, where):
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


class _WdsEpoch(IterableDataset):
    """One rank's epoch as whole batches, split over DataLoader workers in contiguous batch ranges.

    The epoch's sample sequence is the shards in a per-epoch permuted order; the rank reads the
    contiguous range of it that it owns (at most two shards partially), each worker a contiguous piece
    of that, streamed through a seeded shuffle buffer. The DataLoader interleaves workers round-robin, so
    the k-th batch of the epoch is the (k // W)-th batch of the worker in role k % W. After a resume at
    batch k0, DataLoader worker i takes role (i + k0) % W, which keeps that order exactly.
    """

    def __init__(self, loader: "WdsLoader", epoch: int, start_batch: int):
        self.loader, self.epoch, self.start_batch = loader, epoch, start_batch

    def _views(self, first_batch: int, last_batch: int) -> list[int]:
        """Sequence positions of the views in batches [first_batch, last_batch) of this rank's range."""
        ld, s, b = self.loader, self.loader.spec, self.loader.spec.micro_batch_size
        n = ld.num_samples
        if not s.train:
            return [int(p) for p in eval_positions(n, s)[0][first_batch * b: last_batch * b]]
        r = ld.d.repeated_aug
        start = s.rank * math.ceil(ld.views_per_rank / r)
        return [(start + v // r) % n for v in range(first_batch * b, last_batch * b)]

    def _read(self, views: list[int]):
        """Stream (jpeg, label) for each view position, in order, reading each needed shard once."""
        ld = self.loader
        shards = ld.shard_order(self.epoch)
        offsets = np.cumsum([0] + [c for _, c in shards])
        segments, seg = [], []
        for p in views:  # split where the positions wrap around the end of the sequence
            if seg and p < seg[-1]:
                segments.append(seg)
                seg = []
            seg.append(p)
        if seg:
            segments.append(seg)
        for seg in segments:
            counts: dict[int, int] = {}
            for p in seg:
                counts[p] = counts.get(p, 0) + 1
            lo_pos, hi_pos = seg[0], seg[-1]
            for si, (name, count) in enumerate(shards):
                lo = int(offsets[si])
                if lo + count <= lo_pos or lo > hi_pos:
                    continue
                samples = shard_samples(ld.location, name, count, ld.d.open_retries, ld.d.open_retry_backoff_s)
                url = shard_url(ld.location, name)
                for off, (key, jpg, label, reason) in enumerate(samples):
                    for _ in range(counts.get(lo + off, 0)):
                        yield url, key, jpg, label, reason
                    if lo + off >= hi_pos:
                        samples.close()
                        break

    def __iter__(self):
        ld, s, b = self.loader, self.loader.spec, self.loader.spec.micro_batch_size
        info = get_worker_info()
        worker, nw = (info.id, info.num_workers) if info else (0, 1)
        role = (worker + self.start_batch) % nw
        first, last = contiguous_range(len(ld), nw, role)
        stream = self._read(self._views(first, last))
        if s.train:  # seeded per epoch, rank and role: the same order after a resume
            stream = _shuffle_buffer(stream, ld.buffer_size, np.random.default_rng([s.seed, self.epoch, s.rank, role]))
        skip = max(0, (self.start_batch - role + nw - 1) // nw)  # batches of this role already consumed
        for j in range(last - first):
            chunk = [next(stream) for _ in range(b)] if j < last - first - 1 or s.train else list(stream)
            if j < skip:
                continue  # skipped without decoding
            yield self._batch(chunk, role + j * nw)

    def _batch(self, chunk: list, k: int) -> Batch:
        """Batch ``k`` of the epoch from its (shard, key, jpeg, label, reason) items. A sample that could not be
        read or decoded is replaced by the next good sample of the batch (cyclically), augmented with its own
        seed: a function of the batch alone, so a rerun and a resume replace it alike."""
        s, b = self.loader.spec, self.loader.spec.micro_batch_size
        # the rank's views are the contiguous range [rank * V, (rank + 1) * V) of the epoch's sequence
        seeds = view_seeds(s.seed, self.epoch, s.rank * self.loader.views_per_rank + k * b + np.arange(len(chunk)))
        images, labels, failed = [None] * len(chunk), [None] * len(chunk), {}
        for i, (url, key, jpg, label, reason) in enumerate(chunk):
            if reason is None:
                try:
                    img = decode_rgb(jpg)
                except DECODE_ERRORS as e:
                    reason = f"undecodable image ({reason_of(e)})"
            if reason is not None:
                failed[i] = {"shard": url, "key": key, "reason": reason}
                continue
            seed_host(int(seeds[i]))
            images[i], labels[i] = self.loader.transform(img), label
        for i, record in failed.items():
            j = next_good(failed, i, len(chunk))
            if j is None:
                raise DataError(f"{record['shard']}: no readable sample in batch {k} of epoch {self.epoch} "
                                f"(key {record['key']}: {record['reason']})")
            seed_host(int(seeds[i]))
            images[i], labels[i] = self.loader.transform(decode_rgb(chunk[j][2])), chunk[j][3]
        on_device = s.train and s.augment_on_device  # the device augments each sample from its seed
        return Batch(torch.stack(images), torch.tensor(labels, dtype=torch.long),
                     torch.from_numpy(seeds.astype(np.int64)) if on_device else None, bad=list(failed.values()))


def _shuffle_buffer(items, size: int, rng: np.random.Generator):
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


class WdsLoader:
    """WebDataset shards through a torch DataLoader whose workers read contiguous batch ranges."""

    def __init__(self, d: DataConfig, spec: LoaderSpec, buffer_size: int = 2000):
        self.location = d.train_path if spec.train else d.val_path
        manifest = read_manifest(self.location)
        if spec.split not in manifest.get("splits", {}):
            raise DataError(f"{self.location}: manifest has no {spec.split!r} split")
        prepared_f = manifest["options"].get("subset_fraction", 1.0)
        if spec.train and not math.isclose(prepared_f, d.subset_fraction):
            raise DataError(f"{self.location}: shards hold subset_fraction={prepared_f}, the recipe asks "
                            f"{d.subset_fraction}; convert with `convit-scale prep wds --subset-fraction "
                            f"{d.subset_fraction}` (WebDataset subsets are made at conversion)")
        files = manifest["splits"][spec.split]["files"]
        self.shards = [(name, rec["samples"]) for name, rec in sorted(files.items())]
        self.num_samples = sum(c for _, c in self.shards)
        self.d, self.spec, self.buffer_size = d, spec, buffer_size
        on_device = spec.augment_on_device
        self.transform = (build_train_transform(d, spec.img_size, on_device) if spec.train
                          else build_eval_transform(d, spec.img_size, on_device))
        self.geometry = EpochGeometry.of(self.num_samples, spec, self.location)
        self.views_per_rank, self.num_real = self.geometry.views_per_rank, self.geometry.num_real

    def __len__(self) -> int:
        return self.geometry.num_batches

    def shard_order(self, epoch: int) -> list[tuple[str, int]]:
        if not self.spec.train:
            return self.shards
        return [self.shards[i] for i in epoch_permutation(len(self.shards), self.spec.seed, epoch)]

    def epoch(self, epoch: int, start_batch: int = 0):
        workers = min(self.d.num_workers, len(self))
        loader = DataLoader(_WdsEpoch(self, epoch, start_batch), batch_size=None, pin_memory=self.spec.pin_memory,
                            **loader_options(workers, self.spec.seed, epoch))
        yield from limit_bad_samples(iterate(loader), self.d.max_bad_samples, epoch, self.spec.rank)
