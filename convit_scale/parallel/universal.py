"""A ZeRO checkpoint resumed on another number of ranks goes through DeepSpeed's universal checkpoint: rank 0 converts
it once (``universal_checkpoint``), the other ranks wait for it (``conversion_wait_s``), then every rank loads its new
partitions.

The conversion writes a fragment file per parameter, optimizer state and saved rank (ConViT-B+ under ZeRO-3 on 32
ranks: up to 24k small files) before merging them into a file per parameter and state: the fragments go to a
node-local folder when there is one (``scratch_dir``), and only the merged result reaches the checkpoint's folder,
fsynced and marked complete by a file written last. A folder without that mark (a crash, an older release that
published by a rename alone) is converted again.
"""

from __future__ import annotations

import contextlib
import io
import os
import shutil
import sys
import tempfile
import types
from pathlib import Path

from ..files import publish_dir, write_json_atomic

UNIVERSAL = "universal"
"""The folder of a ZeRO checkpoint that holds its DeepSpeed universal checkpoint, once converted."""
COMPLETE = "converted.json"
"""The last file a conversion writes into ``UNIVERSAL`` (its files and bytes, the DeepSpeed that wrote them): the
folder is a finished conversion only with it."""

UNIVERSAL_ZERO3_SINCE = (0, 19)
"""The oldest DeepSpeed release whose universal conversion was seen to handle a ZeRO-3 checkpoint (0.19.8 converts;
0.16.0 and 0.17.0 fail on the padding of ZeRO-3's partitions: "start (N) + length (L) exceeds dimension size (N)")."""

SCRATCH_ENV = ("SLURM_TMPDIR", "TMPDIR")
"""Where a node-local folder is named when ``parallel.zero_universal_scratch`` is not set: Slurm's per-job folder on
the node (many sites set it), then TMPDIR."""
SCRATCH_MARGIN = 3
"""Free space a scratch folder needs, in multiples of the checkpoint's bytes: the fragments and the merged files
(each about the checkpoint's optimizer state) with room to spare; a fuller one is not used."""


def universal_problem(strategy: str, deepspeed_version: str) -> str | None:
    """Why this DeepSpeed cannot convert a ``strategy`` checkpoint to a universal one, or None."""
    release = tuple(int(x) for x in deepspeed_version.split("+")[0].split(".")[:2])
    if strategy == "zero3" and release < UNIVERSAL_ZERO3_SINCE:
        since = ".".join(map(str, UNIVERSAL_ZERO3_SINCE))
        return (f"a ZeRO-3 checkpoint converts to DeepSpeed's universal checkpoint with DeepSpeed >= {since} "
                f"(installed: {deepspeed_version}); upgrade DeepSpeed, or resume on the world size the checkpoint "
                f"was written on")
    return None


def folder_bytes(folder: Path) -> int:
    """The bytes of the files under ``folder``."""
    return sum(f.stat().st_size for f in folder.rglob("*") if f.is_file())


def is_converted(folder: Path) -> bool:
    """Whether ``folder`` is a finished conversion: it holds ``COMPLETE``, which is written last."""
    return (folder / COMPLETE).is_file()


def scratch_dir(configured: str | None) -> Path | None:
    """The node-local folder for the conversion's fragments: ``parallel.zero_universal_scratch`` (made if missing),
    else the first of ``SCRATCH_ENV`` that names a folder, else None (the fragments are written beside the
    checkpoint)."""
    if configured:
        Path(configured).mkdir(parents=True, exist_ok=True)
        return Path(configured)
    for candidate in (os.environ.get(k) for k in SCRATCH_ENV):
        if candidate and Path(candidate).is_dir():
            return Path(candidate)
    return None


def _usable(scratch: Path | None, needed: int) -> Path | None:
    """``scratch`` if it has ``SCRATCH_MARGIN`` times ``needed`` bytes free (said on stderr when it has not)."""
    if scratch is None:
        return None
    free = shutil.disk_usage(scratch).free
    if free >= SCRATCH_MARGIN * needed:
        return scratch
    print(f"[convit-scale] {scratch}: {free / 1e9:.1f} GB free, the universal conversion needs about "
          f"{SCRATCH_MARGIN * needed / 1e9:.1f} GB: converting beside the checkpoint instead", file=sys.stderr,
          flush=True)
    return None


def _convert(source: Path, output: Path) -> None:
    """DeepSpeed's ``ds_to_universal`` of ``source`` (a ZeRO checkpoint's tag folder) into ``output``, in this process
    (one extraction and one merge worker: no child process from a training rank), its own fragments in
    ``output/tmp``, removed when it is done."""
    from deepspeed.checkpoint.ds_to_universal import main as ds_to_universal

    args = types.SimpleNamespace(input_folder=str(source), output_folder=str(output), num_extract_workers=1,
                                 num_merge_workers=1, keep_temp_folder=False, strict=True, inject_missing_state=True)
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):  # not the run's log
        ds_to_universal(args)


def universal_checkpoint(directory: Path, scratch: Path | None = None) -> Path:
    """``directory/universal``: DeepSpeed's universal checkpoint of the ZeRO state in ``directory/zero`` (any stage),
    converted once. The conversion runs in ``scratch`` (a node-local folder, when given and large enough) or in
    ``universal.tmp`` beside the checkpoint; its result is copied into ``universal.tmp``, marked ``COMPLETE`` and
    published by ``files.publish_dir`` (fsynced, then renamed). A ``universal`` folder without the mark is removed and
    converted again; a crash at any point leaves no marked ``universal``."""
    import deepspeed

    final, tmp = directory / UNIVERSAL, directory / (UNIVERSAL + ".tmp")
    if is_converted(final):
        return final
    shutil.rmtree(final, ignore_errors=True)
    shutil.rmtree(tmp, ignore_errors=True)
    source = directory / "zero"
    local = _usable(scratch, folder_bytes(source))
    work = tempfile.TemporaryDirectory(prefix="convit-universal-", dir=local) if local else contextlib.nullcontext()
    with work as folder:
        out = Path(folder) / UNIVERSAL if folder else tmp
        out.mkdir()
        _convert(source, out / "zero")
        if folder:
            shutil.copytree(out, tmp)  # the merged files only: the fragments stay on the node
    files = [f for f in tmp.rglob("*") if f.is_file()]
    write_json_atomic(tmp / COMPLETE, {"files": len(files), "bytes": sum(f.stat().st_size for f in files),
                                       "deepspeed": deepspeed.__version__, "scratch": str(local) if local else None})
    publish_dir(tmp, final)
    return final


CONVERSION_BYTES_PER_S = 5e6
"""The slowest conversion rate the other ranks wait for: about a twentieth of ``universal_checkpoint``'s rate on 2 CPU
cores and a local disk (ConViT-B+ under ZeRO-3, 1.8 GB in 20 s: BENCHMARKS.md, "Elastic resume"), for a shared file
system several times slower."""
CONVERSION_FILE_S = 0.02
"""The slowest time per file the other ranks wait for: a small file's create, write, close and later read on a busy
shared file system (a few metadata round trips of 2-5 ms each on Lustre or GPFS), where the fragments go when no
node-local folder is given."""
UNIVERSAL_STATES = 4
"""Files a parameter tensor makes per saved rank in the conversion: fp32 weights, two Adam moments, step."""


def conversion_files(tensors: int, saved_world_size: int) -> int:
    """At most how many files a conversion writes: a fragment per parameter tensor, state and saved rank (ZeRO-3
    partitions every tensor over every rank; ZeRO-1/2 split fewer), then the merged file per tensor and state."""
    return tensors * UNIVERSAL_STATES * (saved_world_size + 1)


def conversion_wait_s(directory: Path, timeout_s: float, tensors: int, saved_world_size: int) -> float:
    """How long the other ranks wait for rank 0's conversion of ``directory``'s ZeRO checkpoint (``tensors`` parameter
    tensors, saved on ``saved_world_size`` ranks): the process group's timeout, plus its bytes at
    ``CONVERSION_BYTES_PER_S``, plus its files at ``CONVERSION_FILE_S`` (ConViT-B+ under ZeRO-3, 1.8 GB of 180 tensors
    from 32 ranks: 600 + 363 + 475 s)."""
    return (timeout_s + folder_bytes(directory / "zero") / CONVERSION_BYTES_PER_S
            + conversion_files(tensors, saved_world_size) * CONVERSION_FILE_S)
