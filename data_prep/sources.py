"""Where a conversion reads its images: an ImageNet-style tree, WebDataset shards another tool wrote, or Parquet files
(ImageNet-1k as it is published in Parquet: ``data/train-00000-of-00257.parquet``, an image column of bytes or of
``{bytes, path}`` structs and an integer label column).

Every sample is a reference (``Sample.path``) that ``read_bytes`` turns into the image's bytes, in any process: a
file's path; ``tar:SHARD#OFFSET+SIZE`` for a member of a tar (its data read at that offset, no tar walk); or
``parquet:FILE#ROW/COLUMN``, read by row group (a process keeps the last few row groups it read, decoded).
References sort in source order (zero-padded numbers), so a Table 2 subset keeps the first images of each class as
they come.

Nothing is unpacked: the check phase and the writers read the sources where they lie. Parquet row groups are read
in order, so a conversion from Parquet keeps the source's order (``ORDERED``): FFCV files do not need another
(subsets and the epoch order are taken at load time), and WebDataset shards keep it, which a source sorted by class
cannot give (each shard would hold one or two classes): such a source is refused for ``prep wds``.
"""

from __future__ import annotations

import bisect
import collections
import tarfile
from pathlib import Path

from convit_scale.imagetree import PrepError, Sample, rgb_jpeg
from convit_scale.manifest import DataError, Manifest, described, read_label, split_in_name

TREE, WDS, PARQUET = "tree", "wds", "parquet"
ORDERED = (PARQUET,)
"""Sources read in their own order (random access would read a row group per image)."""


def source_kind(src: Path) -> str:
    """``TREE`` (a train/ folder), ``PARQUET`` (*.parquet files under it) or ``WDS`` (a folder of tar
    shards with a manifest or timm's _info.json); else a PrepError naming what was looked for."""
    if (src / "train").is_dir():
        return TREE
    if any(src.rglob("*.parquet")):
        return PARQUET
    if described(str(src)):
        return WDS
    if any(src.glob("*.tar")):
        raise PrepError(f"--src {src}: WebDataset shards without a description; run `convit-scale prep index {src}` "
                        f"first (or give timm's _info.json)")
    raise PrepError(f"--src {src}: neither an ImageNet-style tree (class folders in train/), WebDataset shards (with "
                    f"manifest.json or _info.json), nor Parquet files")


def read_bytes(ref: str) -> bytes:
    """The image bytes of a sample reference (the module says what references are)."""
    if ref.startswith("tar:"):
        path, _, span = ref[4:].rpartition("#")
        offset, _, size = span.partition("+")
        f = _open_shard(path)
        f.seek(int(offset))
        data = f.read(int(size))
        if len(data) != int(size):
            raise OSError(f"{path}: member at {int(offset)} truncated ({len(data)} of {int(size)} bytes)")
        return data
    if ref.startswith("parquet:"):
        path, _, cell = ref[8:].rpartition("#")
        row, _, column = cell.partition("/")
        return _ParquetRows.of(path, column).read(int(row))
    return Path(ref).read_bytes()


def describe(ref: str) -> str:
    """A sample reference as a person finds it: a file's path, a shard's member (its tar header, the block before its
    bytes), a Parquet file's row and column."""
    if ref.startswith("tar:"):
        path, _, span = ref[4:].rpartition("#")
        offset = int(span.partition("+")[0])
        try:
            f = _open_shard(path)
            f.seek(offset - tarfile.BLOCKSIZE)
            name = tarfile.TarInfo.frombuf(f.read(tarfile.BLOCKSIZE), "utf-8", "surrogateescape").name
        except (OSError, tarfile.TarError, ValueError):
            name = f"at byte {offset}"
        return f"{path} member {name}"
    if ref.startswith("parquet:"):
        path, _, cell = ref[8:].rpartition("#")
        row, _, column = cell.partition("/")
        return f"{path} row {row} column {column}"
    return ref


def load_rgb_jpeg(ref: str) -> tuple[bytes | None, str | None, bool]:
    """``imagetree.load_rgb_jpeg`` of any source's sample: (JPEG bytes of an RGB image, skip reason, converted?)."""
    return rgb_jpeg(read_bytes(ref))


_SHARDS: collections.OrderedDict[str, object] = collections.OrderedDict()
"""The tar shards a process has open (a few: a shard's samples are read one after the other; one open per sample
would be a metadata operation each on a parallel file system)."""


def _open_shard(path: str):
    if path in _SHARDS:
        _SHARDS.move_to_end(path)
        return _SHARDS[path]
    if len(_SHARDS) >= 8:
        _SHARDS.popitem(last=False)[1].close()
    _SHARDS[path] = f = open(path, "rb")  # noqa: SIM115 - kept open for the next samples of the shard
    return f


def list_source(src: Path, kind: str, splits: tuple[str, ...], image_column: str = "image",
                label_column: str = "label") -> tuple[list[str], dict[str, list[Sample]]]:
    """(class names, or [] where the source has none; {split: samples in source order}) of a WebDataset or Parquet
    source. Lists the samples only: no image is decoded (WebDataset: tar headers and label members)."""
    if kind == WDS:
        manifest = Manifest.read(src)
        listed = {s: _tar_samples(manifest, s) for s in splits if _has(manifest, s)}
        return manifest.classes, listed
    files = sorted(src.rglob("*.parquet"))
    listed = {}
    for split in splits:
        mine = [f for f in files if split_in_name(f.name) == split]
        if mine:
            listed[split] = [s for f in mine for s in _parquet_samples(f, image_column, label_column)]
    return [], listed


def _has(manifest: Manifest, split: str) -> bool:
    try:
        manifest.split(split)
        return True
    except DataError:  # the split is not there
        return False


def _tar_samples(manifest: Manifest, split: str) -> list[Sample]:
    """Each sample of the split's shards (name order): its JPEG member's place in the tar, and its label."""
    samples, label = [], manifest.label_member
    ext = "." + label.partition(":")[0]
    for name, _ in manifest.split(split).shards():
        path = manifest.folder / name
        jpgs, labels = {}, {}
        with tarfile.open(path, "r") as tar:
            for m in tar:
                stem, dot, member_ext = m.name.rpartition(".")
                if "." + member_ext == ext:
                    labels[stem] = read_label(tar.extractfile(m).read(), label)
                elif member_ext == "jpg":
                    jpgs[stem] = (m.offset_data, m.size)
        missing = sorted(set(jpgs) ^ set(labels))
        if missing:
            raise PrepError(f"{path}: sample {missing[0]!r} has no {'.jpg' if missing[0] in labels else ext} member")
        samples += [Sample(f"tar:{path}#{off:015d}+{size}", labels[k]) for k, (off, size) in
                    sorted(jpgs.items(), key=lambda kv: kv[1][0])]
    return samples


def _parquet_samples(path: Path, image_column: str, label_column: str) -> list[Sample]:
    import pyarrow.parquet as pq

    f = pq.ParquetFile(path)
    names = f.schema_arrow.names
    for column, option in ((image_column, "--image-column"), (label_column, "--label-column")):
        if column not in names:
            raise PrepError(f"{path}: no column {column!r} (it has: {', '.join(names)}); name it with {option}")
    labels = f.read(columns=[label_column], use_threads=False).column(label_column).to_pylist()  # before a fork
    if any(not isinstance(v, int) or isinstance(v, bool) or v < 0 for v in labels):
        raise PrepError(f"{path}: column {label_column!r} holds other values than labels 0..N-1; name the integer "
                        f"label column with --label-column")
    return [Sample(f"parquet:{path}#{row:012d}/{image_column}", label) for row, label in enumerate(labels)]


class _ParquetRows:
    """A Parquet file's image cells, a row group at a time; the last ``KEEP`` row groups a process read stay
    decoded (the check phase and the writers read rows in order, a few workers interleaved)."""

    KEEP = 4
    files: dict[tuple[str, str], "_ParquetRows"] = {}

    def __init__(self, path: str, column: str):
        import pyarrow.parquet as pq

        self.file, self.column = pq.ParquetFile(path), column
        meta = self.file.metadata
        self.starts = [0]
        for g in range(meta.num_row_groups):
            self.starts.append(self.starts[-1] + meta.row_group(g).num_rows)
        self.groups: collections.OrderedDict[int, list] = collections.OrderedDict()

    @classmethod
    def of(cls, path: str, column: str) -> "_ParquetRows":
        if (path, column) not in cls.files:
            cls.files[(path, column)] = cls(path, column)
        return cls.files[(path, column)]

    def read(self, row: int) -> bytes:
        g = bisect.bisect_right(self.starts, row) - 1
        if g not in self.groups:
            if len(self.groups) >= self.KEEP:
                self.groups.popitem(last=False)
            self.groups[g] = self._cells(g)
        cell = self.groups[g][row - self.starts[g]]
        return cell["bytes"] if isinstance(cell, dict) else cell

    def _cells(self, g: int) -> list:
        """The image column of row group ``g`` as Python values (bytes, or {bytes, path} structs)."""
        return self.file.read_row_group(g, columns=[self.column], use_threads=False).column(self.column).to_pylist()
