"""``prep verify``: every output file re-read and checked against the manifest (checksums, sample and per-class
counts, label range), and with a source tree, the manifest checked against the tree. FFCV files and WebDataset
shards another tool wrote are checked the same way, against what their own description records: shards indexed
where they lie (``prep index``) are read from there, remote ones (a URL template) streamed as the loaders stream
them; FFCV fields named otherwise are named with ``ffcv_fields`` (``--ffcv-fields``, as ``data.ffcv_fields``).
Data with no manifest (timm's ``_info.json`` alone, FFCV files read in place) has no checksum that vouches for its
images, which were never decoded on the way in: a sample of each split's images (``DECODE_SAMPLE``) is decoded as
the loaders decode it, and each that fails is named: a shard's member as timm's reader decodes it (PIL), an FFCV
file's sample (by its index) as the FFCV loader does, a JPEG with turbojpeg (``convit_scale.jpeg``: it refuses what
PIL decodes with a warning, a JPEG cut short among them), raw pixels by their stored size."""

from __future__ import annotations

import hashlib
import math
import tarfile
from pathlib import Path

import numpy as np

from convit_scale.ffcv_threads import importing_ffcv
from convit_scale.imagetree import list_classes, rgb_jpeg, scan_split, subsample
from convit_scale.jpeg import decode_rgb_array
from convit_scale.manifest import (
    FFCV_FIELDS,
    FIELDS_OPTION,
    MANIFEST,
    TIMM_INFO,
    DataError,
    Manifest,
    described,
    read_ffcv_labels,
    read_label,
)
from convit_scale.streams import CommandStream, open_stream, shard_url

from .checks import class_counts, sha256_file

DECODE_SAMPLE = 1000
"""Images decoded per split of shards without a manifest, evenly spaced (all of a smaller split): a bound on the
time this adds, whatever the split's size."""


class _DecodeSample:
    """Decodes every ``stride``-th image of a split's files (``DECODE_SAMPLE`` of them) and names those that fail."""

    def __init__(self, num_samples: int):
        self.stride = max(1, math.ceil(num_samples / DECODE_SAMPLE))
        self.seen, self.decoded, self.failed = 0, 0, []

    def picks(self, count: int) -> range:
        """The indices, among the split's next ``count`` images, of those to decode."""
        first = -self.seen % self.stride
        self.seen += count
        return range(first, count, self.stride)

    def __call__(self, where, member: str, payload: bytes) -> None:
        """A shard's image member, decoded as timm's reader decodes it (PIL), if it is one of the sample."""
        if self.picks(1):
            self.record(f"{where}: member {member}", rgb_jpeg(payload)[1])

    def record(self, image: str, reason: str | None) -> None:
        """One image of the sample decoded: ``reason`` why it failed, or None."""
        self.decoded += 1
        if reason is not None:
            self.failed.append(f"{image} does not decode ({reason})")


def _decoded(decoded: int, samples: int) -> str:
    """What the ``checked`` line says of the images decoded, of ``samples`` in all."""
    return f"{decoded} of {samples} images decoded" + (" (a sample)" if decoded < samples else "")


def verify(out: str | Path, src: str | Path | None = None, ffcv_fields: tuple[str, str] = FFCV_FIELDS,
           notes: list[str] | None = None, checked: list[str] | None = None) -> list[str]:
    """Re-read every output file of ``out`` and check it against the manifest; with ``src``, also check the
    manifest against that source tree (:func:`check_source`). ``ffcv_fields``: the image and label fields of FFCV
    files read in place. Returns the problems found; what was not checked, and why, is appended to ``notes``, and
    what was checked (against the manifest, or without one: against what, and the images decoded) to ``checked``."""
    out = Path(out)
    notes = [] if notes is None else notes
    checked = [] if checked is None else checked
    if not described(str(out)):
        return [f"{out}: no manifest.json (nor timm's _info.json, nor FFCV files); allowed: a `convit-scale prep` "
                f"output, or data another tool wrote that the loaders read in place"]
    try:
        manifest = Manifest.read(out, ffcv_fields)
    except DataError as e:
        return [str(e)]
    location = manifest.shard_location
    remote = "{name}" in location
    if remote and manifest.format == "ffcv":
        return [f"{out}: FFCV files at a URL template ({location}); allowed: FFCV files in a local folder"]
    problems = []
    if not manifest.num_classes:
        notes.append(f"{out}: the class count is unknown (no class names or per-class counts, as in timm's "
                     f"{TIMM_INFO}): labels checked to be >= 0 only; `convit-scale prep index` counts the classes")
    own = remote or (out / MANIFEST).is_file()
    samples = decoded = 0
    for split, info in manifest.splits.items():
        decode = None if own else _DecodeSample(info.num_samples)
        counts: dict[str, int] = {}
        for name, rec in info.files.items():
            where = shard_url(location, name) if remote else manifest.folder / name
            labels = _check_file(manifest, where, rec, remote, ffcv_fields, problems, decode)
            for k, v in class_counts(labels).items():
                counts[k] = counts.get(k, 0) + v
        if info.per_class and counts != info.per_class and not any(split in p for p in problems):
            problems.append(f"{split}: samples per class differ from the manifest")
        if decode is not None:
            problems += decode.failed
            samples, decoded = samples + info.num_samples, decoded + decode.decoded
    if own:
        checked.append("every file matches the manifest")
    elif manifest.format == "wds":
        checked.append(f"no {MANIFEST}: every shard read against timm's {TIMM_INFO} (samples, labels); "
                       f"{_decoded(decoded, samples)}")
    else:
        checked.append(f"no {MANIFEST}: every FFCV file's label column read (samples, labels); "
                       f"{_decoded(decoded, samples)}")
    return problems + (check_source(manifest, Path(src)) if src is not None else [])


def _check_file(manifest: Manifest, where, rec: dict, remote: bool, ffcv_fields: tuple[str, str],
                problems: list[str], decode: _DecodeSample | None = None) -> list[int]:
    """The labels of one output file, its problems against the manifest appended to ``problems``."""
    n_classes = manifest.num_classes
    if not remote and not where.is_file():
        problems.append(f"{where}: missing")
        return []
    try:
        if remote:
            labels, digest = _read_remote(where, manifest.label_member)
        else:
            labels, digest = _read_labels(where, manifest.format, manifest.label_member, ffcv_fields, decode), None
    except Exception as e:  # a truncated tar or beton, a failed command, is reported, not raised
        if not remote and "sha256" in rec and sha256_file(where) != rec["sha256"]:
            problems.append(f"{where}: checksum differs from the manifest (corrupt or changed)")
        problems.append(f"{where}: unreadable ({type(e).__name__}: {e})")
        return []
    if "sha256" in rec and (digest or sha256_file(where)) != rec["sha256"]:
        problems.append(f"{where}: checksum differs from the manifest (corrupt or changed)")
    if len(labels) != rec["samples"]:
        problems.append(f"{where}: {len(labels)} samples, manifest says {rec['samples']}")
    if n_classes and any(not 0 <= label < n_classes for label in labels):
        problems.append(f"{where}: labels outside 0..{n_classes - 1}")
    elif not n_classes and any(label < 0 for label in labels):
        problems.append(f"{where}: negative labels (the class count is unknown; allowed: labels >= 0)")
    return labels


def check_source(manifest: Manifest, src: Path) -> list[str]:
    """The manifest accounts for every image of ``src`` it should hold: the same classes, and per split as many
    images written plus listed as skipped as the tree has (after the manifest's subset fraction). Lists files
    only; reads no image."""
    if not (src / "train").is_dir():
        return [f"--src {src}: no train folder (allowed: the ImageNet-style tree the output was converted from)"]
    opts = manifest.options
    classes = list_classes(src / "train")
    if classes != manifest.classes:
        return [f"--src {src}: {len(classes)} class folders in train/, the manifest has {manifest.num_classes} "
                f"classes, or other names (converted from {manifest.source})"]
    problems = []
    for split in opts["splits"]:
        info = manifest.splits.get(split)
        if info is None:
            if (src / split).is_dir():
                problems.append(f"{src / split}: in the source but not in the manifest")
            continue
        samples, unlabelled = scan_split(src, split, classes, _opt_path(opts["val_labels"]),
                                         _opt_path(opts["val_synsets"]))
        if split == "train":
            samples = subsample(samples, opts["subset_fraction"])
        accounted = info.num_samples + len(info.skipped)
        if len(samples) + len(unlabelled) != accounted:
            problems.append(f"{src / split}: {len(samples)} images (subset fraction {opts['subset_fraction']:g}) and "
                            f"{len(unlabelled)} unlabelled file(s), but the manifest accounts for {accounted} "
                            f"({info.num_samples} written, {len(info.skipped)} skipped)")
    return problems


def _opt_path(value: str | None) -> Path | None:
    return Path(value) if value else None


def _read_labels(path: Path, fmt: str, label: str = "cls", ffcv_fields: tuple[str, str] = FFCV_FIELDS,
                 decode: _DecodeSample | None = None) -> list[int]:
    if fmt == "ffcv":
        labels = read_ffcv_labels(path, ffcv_fields).tolist()
        if decode is not None:
            _decode_ffcv(path, ffcv_fields[0], decode)
        return labels
    with tarfile.open(path, "r") as tar:
        return _tar_labels(tar, label, decode=None if decode is None else
                           lambda member, payload: decode(path, member, payload))


def _decode_ffcv(path: Path, image: str, decode: _DecodeSample) -> None:
    """The sample's images of the FFCV file at ``path`` (its field ``image``, an ``RGBImageField``), each as the FFCV
    loader decodes it (``_ffcv_image_fails``), a failure named by file and sample index. The image's bytes are found
    as ffcv's readers find them: at the field's data pointer, the size its allocation table records there."""
    with importing_ffcv():
        from ffcv.fields import RGBImageField
        from ffcv.fields.rgb_image import IMAGE_MODES
        from ffcv.reader import Reader

    reader = Reader(str(path))
    if not isinstance(reader.handlers[image], RGBImageField):
        raise DataError(f"{path}: FFCV field {image!r} is a {type(reader.handlers[image]).__name__}, not an "
                        f"RGBImageField; set {FIELDS_OPTION} to the file's [image, label] names")
    field = reader.metadata[f"f{reader.field_names.index(image)}"]
    order = np.argsort(reader.alloc_table["ptr"])
    ptrs, sizes = reader.alloc_table["ptr"][order], reader.alloc_table["size"][order]
    data = np.memmap(path, np.uint8, mode="r")
    for k in decode.picks(len(field)):
        ptr = int(field["data_ptr"][k])
        at = min(int(np.searchsorted(ptrs, ptr)), len(ptrs) - 1)
        if int(ptrs[at]) != ptr:
            decode.record(f"{path}: sample {k}", f"its data pointer {ptr} is not in the file's allocation table")
            continue
        decode.record(f"{path}: sample {k}", _ffcv_image_fails(
            data[ptr:ptr + int(sizes[at])], field["mode"][k] == IMAGE_MODES["jpg"], int(field["height"][k]),
            int(field["width"][k])))


def _ffcv_image_fails(payload: np.ndarray, jpeg: bool, height: int, width: int) -> str | None:
    """Why the FFCV loader cannot decode an image stored as ``payload`` (``convit_scale/data/ffcv_decoders.py``), or
    None: a JPEG is decoded with turbojpeg and no flags (``convit_scale.jpeg``, PIL's pixels), which also refuses a
    JPEG PIL decodes with a warning (a JPEG cut short and ended there, as a copy that stopped); raw pixels are copied
    as stored, ``height x width x 3`` bytes."""
    if not jpeg:
        expected = height * width * 3
        return None if payload.size == expected else (
            f"raw pixels: {payload.size} bytes stored, {height} x {width} x 3 = {expected} expected")
    if decode_rgb_array(payload, height, width) is not None:
        return None
    return f"turbojpeg, the FFCV loader's decoder, refused it; PIL: {rgb_jpeg(bytes(payload))[1] or 'decodes it'}"


def _tar_labels(tar: tarfile.TarFile, label: str, decode=None) -> list[int]:
    """The label of each sample of an open tar (each label member's), every image member read through: a truncated
    member raises; ``decode(member name, bytes)`` is given each image."""
    labels, ext = [], "." + label.partition(":")[0]
    for member in tar:
        if member.name.endswith(ext):
            labels.append(read_label(tar.extractfile(member).read(), label))
        elif member.name.endswith(".jpg"):
            payload = tar.extractfile(member).read()
            if len(payload) != member.size:
                raise tarfile.ReadError(f"member {member.name} truncated")
            if decode is not None:
                decode(member.name, payload)
    return labels


class _Hashed:
    """A stream read through, its bytes hashed (a remote shard is read once: its labels and its checksum)."""

    def __init__(self, stream):
        self.stream, self.sha = stream, hashlib.sha256()

    def read(self, size: int = -1) -> bytes:
        data = self.stream.read(size)
        self.sha.update(data)
        return data

    def rest(self) -> str:
        """Read what the tar reader left (its end blocks) and return the checksum of the whole."""
        while self.read(1 << 20):
            pass
        return self.sha.hexdigest()


def _read_remote(url: str, label: str) -> tuple[list[int], str]:
    """(labels, sha256) of the shard at ``url``, streamed once as the loaders stream it (``convit_scale.streams``);
    a command that fails is a failed read (OSError, with the command's own reason)."""
    stream = open_stream(url)
    try:
        hashed = _Hashed(stream)
        try:
            with tarfile.open(fileobj=hashed, mode="r|") as tar:
                labels = _tar_labels(tar, label)
            digest = hashed.rest()
            if isinstance(stream, CommandStream):
                stream.finish()
        except (OSError, tarfile.TarError, EOFError) as e:
            failure = stream.failure(wait=True) if isinstance(stream, CommandStream) else None
            if failure:
                raise OSError(failure) from e
            raise
        return labels, digest
    finally:
        stream.close()
