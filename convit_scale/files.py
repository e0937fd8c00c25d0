"""Files and folders published whole: written under a temporary name, flushed to disk, then renamed into place.

A reader (a resumed run, another rank, ``prep verify``, a person) sees the old content or the new, never a part: on a
POSIX file system ``os.replace`` is atomic, and the data is fsynced before it, so that a crash or a lost node right
after the rename cannot publish a name whose bytes never reached the disk. Every atomic write of the package goes
through here.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
from collections.abc import Iterator
from pathlib import Path


def fsync_dir(path: Path) -> None:
    """Flush a folder's entries (the names created or renamed in it)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_file(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_tree(path: Path) -> None:
    """Flush every file under ``path`` and the folders themselves."""
    for dirpath, _, names in os.walk(path):
        for name in names:
            fsync_file(Path(dirpath) / name)
        fsync_dir(Path(dirpath))


def _umask() -> int:
    # /proc reads it without changing it (os.umask sets it, a race with other threads creating files)
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    except OSError:
        pass
    old = os.umask(0o022)
    os.umask(old)
    return old


def readable_mode(path: Path) -> None:
    """Give a file the mode an ordinary ``open`` would (0666 less the umask, 0644 usually): safetensors' writer
    creates its files 0600, which a teammate evaluating a checkpoint or an export cannot read."""
    os.chmod(path, 0o666 & ~_umask())


def _tmp_name(path: Path) -> Path:
    # per process: two writers of the same file (ranks, a prep resumed beside a crashed one) never share a temporary
    return path.with_name(f".{path.name}.{os.getpid()}.tmp")


@contextlib.contextmanager
def atomic_path(path: str | Path, fsync: bool = True) -> Iterator[Path]:
    """A temporary path beside ``path`` for a writer that writes a file itself (safetensors, PIL, a tar writer); on
    leaving the block without an exception it is flushed and renamed to ``path``, else removed."""
    path = Path(path)
    tmp = _tmp_name(path)
    try:
        yield tmp
        if tmp.is_file():
            readable_mode(tmp)
        if fsync:
            fsync_file(tmp)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    if fsync:
        fsync_dir(path.parent)


def write_atomic(path: str | Path, data: str | bytes, fsync: bool = True) -> Path:
    """Write ``data`` (text as UTF-8, or bytes) to ``path`` as one publication."""
    path = Path(path)
    with atomic_path(path, fsync) as tmp:
        tmp.write_bytes(data.encode() if isinstance(data, str) else data)
    return path


def write_json_atomic(path: str | Path, obj, fsync: bool = True) -> Path:
    """``obj`` as indented JSON (a trailing newline), published as :func:`write_atomic` does."""
    return write_atomic(path, json.dumps(obj, indent=1) + "\n", fsync)


def publish_dir(tmp: Path, final: Path) -> None:
    """Make the complete folder ``tmp`` (all files written) ``final``: fsynced, then an atomic rename. A ``final``
    already there (the same checkpoint step saved again, a new best) stays complete until the new one is in place,
    as ``final.old``, which :func:`recover_swap` puts back after a crash between the two renames."""
    fsync_tree(tmp)
    if final.exists():
        old = final.with_name(final.name + ".old")
        shutil.rmtree(old, ignore_errors=True)
        os.replace(final, old)
        os.replace(tmp, final)
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.replace(tmp, final)  # the publication: atomic on a POSIX file system
    fsync_dir(final.parent)


def recover_swap(final: Path, complete: str) -> None:
    """After a crash between :func:`publish_dir`'s two renames no ``final`` exists: publish the new folder
    (``final.tmp``, if it holds the file ``complete``, its last-written file) or else put ``final.old`` back."""
    if final.exists():
        return
    for side in (final.with_name(final.name + ".tmp"), final.with_name(final.name + ".old")):
        if (side / complete).is_file():
            os.replace(side, final)
            return
