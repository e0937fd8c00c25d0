"""The FFCV writer (data_prep/ffcv_writer.py): one .beton per split named by its parameters, in the samples' order with
their labels; under ``write_mode: keep`` each image stored as the check decided (its own JPEG bytes, PIL's RGB pixels
raw, or shrunk and re-encoded); a finished .beton not written again."""

from __future__ import annotations

import hashlib
import io

import numpy as np
from PIL import Image

from convit_scale.ffcv_threads import importing_ffcv
from convit_scale.imagetree import Sample
from data_prep import PrepOptions
from data_prep.checks import KEPT, RAW, RESIZED
from data_prep.ffcv_writer import beton_name, write_ffcv


def _read_back(beton) -> list[tuple[int, int, int, int, bytes]]:
    """(ffcv image mode, height, width, label, stored bytes) of every sample, read back from the file."""
    with importing_ffcv():
        from ffcv.reader import Reader

    reader, data = Reader(str(beton)), beton.read_bytes()
    sizes = {int(p): int(s) for p, s in zip(reader.alloc_table["ptr"], reader.alloc_table["size"])}
    return [(int(m["mode"]), int(m["height"]), int(m["width"]), int(label),
             data[int(m["data_ptr"]):int(m["data_ptr"]) + sizes[int(m["data_ptr"])]])
            for m, label in zip(reader.metadata["f0"], reader.metadata["f1"])]


def test_beton_is_named_by_its_parameters():
    assert beton_name("train", PrepOptions(fmt="ffcv")) == "train_full_keep_q90_f1.beton"
    assert beton_name("val", PrepOptions(fmt="ffcv", max_resolution=256, write_mode="jpg", jpeg_quality=95,
                                         subset_fraction=0.5)) == "val_256_jpg_q95_f0.5.beton"


def test_kept_raw_and_resized_images_are_stored_as_decided_with_their_labels(tmp_path, capfd):
    pixels = np.random.default_rng(0).integers(0, 256, (30, 40, 3), dtype=np.uint8)
    files = {"rgb.JPEG": ("JPEG", (30, 40)), "png.JPEG": ("PNG", (30, 40)), "big.JPEG": ("JPEG", (60, 80))}
    samples = []
    for label, (name, (fmt, size)) in enumerate(files.items()):
        Image.fromarray(pixels).resize(size[::-1]).save(tmp_path / name, format=fmt)
        samples.append(Sample(str(tmp_path / name), label))
    storage = {samples[0].path: KEPT, samples[1].path: RAW, samples[2].path: RESIZED}
    out = tmp_path / "out"
    out.mkdir()
    opts = PrepOptions(fmt="ffcv", max_resolution=40, workers=1)
    files_written = write_ffcv(samples, out, "train", opts, "k", storage)
    (name,) = files_written
    shown = capfd.readouterr()
    assert "it/s]" not in shown.err + shown.out and "ffcv train" in shown.out  # rich's bar alone, not ffcv's tqdm
    assert name == beton_name("train", opts) and files_written[name]["samples"] == 3
    assert files_written[name]["sha256"] == hashlib.sha256((out / name).read_bytes()).hexdigest()
    kept, raw, resized = _read_back(out / name)
    assert [s[3] for s in (kept, raw, resized)] == [0, 1, 2]
    assert kept[0] == 0 and kept[1:3] == (30, 40) and kept[4] == (tmp_path / "rgb.JPEG").read_bytes()
    png = np.asarray(Image.open(tmp_path / "png.JPEG").convert("RGB"))
    assert raw[0] == 1 and raw[1:3] == (30, 40) and raw[4] == png.tobytes()  # PIL's RGB pixels, row by row
    assert resized[0] == 0 and resized[1:3] == (30, 40)  # the longer side shrunk to max_resolution, re-encoded
    assert Image.open(io.BytesIO(resized[4])).size == (40, 30)

    mtime = (out / name).stat().st_mtime_ns
    assert write_ffcv(samples, out, "train", opts, "k", storage) == files_written  # finished: not written again
    assert (out / name).stat().st_mtime_ns == mtime
