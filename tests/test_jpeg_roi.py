"""The crop-region decode (convit_scale/_jpeg_roi.c) gives the whole decode's pixels, then the crop, bit for bit."""

import ctypes.util
import io
import logging
import multiprocessing
import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest
from PIL import Image
from support import PY, run_group
from test_jpeg import encode, photo_like

from convit_scale import jpeg_roi
from convit_scale.jpeg import _decode_whole_box, decode_rgb_array, decode_rgb_box, decode_rgb_box_array

VARIANTS = {
    "4:2:0 q90": dict(quality=90, subsampling=2),
    "4:2:2 q75": dict(quality=75, subsampling=1),
    "4:4:4 q95": dict(quality=95, subsampling=0),
    "progressive 4:2:0": dict(quality=85, progressive=True, subsampling=2),
    "restart markers": dict(quality=90, restart_marker_rows=1),
    "greyscale": dict(quality=90),
}
SIZES = [(375, 500), (499, 333)]  # ImageNet's typical landscape photograph, and an odd portrait one


def boxes(height: int, width: int, rng, n: int) -> list[tuple[int, int, int, int]]:
    """(i, j, h, w): every edge and corner, 1x1 boxes, the whole image, offsets off the MCU grid, then random
    boxes and timm's RandomResizedCrop boxes (scale 0.08-1, ratio 3/4-4/3)."""
    H, W = height, width
    out = [(0, 0, H, W), (0, 0, 1, 1), (H - 1, W - 1, 1, 1), (0, W - 1, 1, 1), (H - 1, 0, 1, 1), (0, 0, H, 1),
           (0, W - 1, H, 1), (H - 1, 0, 1, W), (1, 1, H - 2, W - 2), (7, 9, 17, 15), (15, 15, 2, 2), (16, 16, 16, 16),
           (17, 31, H - 17, W - 31), (H - 33, W - 17, 33, 17), (0, 5, 100, 3), (5, 0, 3, 100)]
    for _ in range(n):
        h, w = int(rng.integers(1, H + 1)), int(rng.integers(1, W + 1))
        out.append((int(rng.integers(0, H - h + 1)), int(rng.integers(0, W - w + 1)), h, w))
    for _ in range(n):
        area = H * W * rng.uniform(0.08, 1.0)
        ratio = np.exp(rng.uniform(np.log(3 / 4), np.log(4 / 3)))
        w, h = int(round(np.sqrt(area * ratio))), int(round(np.sqrt(area / ratio)))
        if 0 < w <= W and 0 < h <= H:
            out.append((int(rng.integers(0, H - h + 1)), int(rng.integers(0, W - w + 1)), h, w))
    return out


@pytest.mark.parametrize("size", SIZES, ids=lambda s: f"{s[0]}x{s[1]}")
@pytest.mark.parametrize("variant", VARIANTS)
def test_box_is_the_whole_decode_cropped(variant, size):
    assert jpeg_roi.AVAILABLE, jpeg_roi.LIBRARY
    height, width = size
    data = encode(photo_like(height, width, seed=height), "L" if variant == "greyscale" else "RGB", **VARIANTS[variant])
    full = decode_rgb_array(data, height, width)
    assert np.array_equal(full, np.asarray(Image.open(io.BytesIO(data)).convert("RGB")))  # PIL's pixels too
    rng = np.random.default_rng(height + len(variant))
    wrong = [(i, j, h, w) for i, j, h, w in boxes(height, width, rng, 60)
             if not np.array_equal(jpeg_roi.decode_box(data, i, j, h, w), full[i:i + h, j:j + w])]
    assert wrong == []
    scratch = np.zeros(height * width * 3, np.uint8)  # the compiled one, as the FFCV decoder calls it
    for i, j, h, w in boxes(height, width, rng, 5):
        assert decode_rgb_box(np.frombuffer(data, np.uint8), scratch, scratch, height, width, i, j, h, w) == 0
        assert np.array_equal(scratch[:h * w * 3].reshape(h, w, 3), full[i:i + h, j:j + w])


@pytest.mark.parametrize("variant", ["4:2:0 q90", "4:2:2 q75", "progressive 4:2:0"])
def test_every_first_row_and_height_near_the_top(variant):
    """jpeg_skip_scanlines keeps the context rows of vertical fancy upsampling: every first row and height across
    the first iMCU rows, and column offsets on and off the iMCU grid."""
    data = encode(photo_like(70, 61, seed=3), **VARIANTS[variant])
    full = decode_rgb_array(data, 70, 61)
    wrong = [(i, j, h, w) for i in range(50) for h in (1, 2, 15, 16, 17, 70 - i) for j, w in ((0, 61), (15, 2),
                                                                                             (17, 30), (58, 3))
             if not np.array_equal(jpeg_roi.decode_box(data, i, j, h, w), full[i:i + h, j:j + w])]
    assert wrong == []


def tj_encode(pixels: np.ndarray, subsampling: int, quality: int = 90) -> bytes:
    """A JPEG written by turbojpeg (tjCompress2), which writes the subsamplings PIL does not: 4:4:0, 4:1:1."""
    import ctypes

    from convit_scale.jpeg import _lib

    init, compress, free = _lib.tjInitCompress, _lib.tjCompress2, _lib.tjFree
    init.restype, free.argtypes = ctypes.c_void_p, [ctypes.c_void_p]
    compress.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_int,
                         ctypes.POINTER(ctypes.c_void_p), ctypes.POINTER(ctypes.c_ulong), ctypes.c_int, ctypes.c_int,
                         ctypes.c_int]
    pixels = np.ascontiguousarray(pixels)
    buf, size, handle = ctypes.c_void_p(), ctypes.c_ulong(), init()
    rc = compress(handle, pixels.ctypes.data, pixels.shape[1], 0, pixels.shape[0], 0, ctypes.byref(buf),
                  ctypes.byref(size), subsampling, quality, 0)
    assert rc == 0
    data = ctypes.string_at(buf, size.value)
    free(buf)
    _lib.tjDestroy(ctypes.c_void_p(handle))
    return data


@pytest.mark.parametrize("subsampling", [4, 5], ids=["4:4:0", "4:1:1"])  # turbojpeg's TJSAMP_440, TJSAMP_411
def test_subsamplings_pil_does_not_write(subsampling):
    data = tj_encode(photo_like(101, 117, seed=2), subsampling)
    full = decode_rgb_array(data, 101, 117)
    wrong = [(i, j, h, w) for i, j, h, w in boxes(101, 117, np.random.default_rng(subsampling), 100)
             if not np.array_equal(jpeg_roi.decode_box(data, i, j, h, w), full[i:i + h, j:j + w])]
    assert wrong == []


def test_refusals_match_the_whole_decode_and_are_counted():
    before = jpeg_roi.counts()
    cmyk = encode(photo_like(40, 52), "CMYK", quality=90)  # turbojpeg refuses RGB output of it: so does this
    assert decode_rgb_array(cmyk, 40, 52) is None and jpeg_roi.decode_box(cmyk, 0, 0, 8, 8) is None
    assert decode_rgb_box_array(cmyk, 40, 52, 0, 0, 8, 8) is None
    assert jpeg_roi.decode_box(b"not a jpeg", 0, 0, 1, 1) is None
    data = encode(photo_like(40, 52), quality=90)
    with pytest.raises(ValueError, match="outside the image"):
        jpeg_roi.decode_box(data, 30, 0, 11, 5)
    assert jpeg_roi.decode_box(data, 1, 2, 3, 4).shape == (3, 4, 3)
    after = jpeg_roi.counts()
    assert after["decoded"] - before["decoded"] == 1 and after["refused"] - before["refused"] == 3


def _decode_in_a_child(data: bytes) -> None:
    jpeg_roi.decode_box(data, 1, 2, 3, 4)
    jpeg_roi.decode_box(data, 0, 0, 8, 8)
    jpeg_roi.decode_box(b"not a jpeg", 0, 0, 1, 1)


def test_a_forked_loader_workers_decodes_are_counted_in_its_parent():
    """A DataLoader worker forked by a rank decodes the rank's train crops: the counters (boxes, refused) that the
    training log reports must be the rank's, where the library's own counters were the worker's alone and the rank
    reported none of them."""
    assert jpeg_roi.AVAILABLE, jpeg_roi.LIBRARY
    before = jpeg_roi.counts()
    child = multiprocessing.get_context("fork").Process(target=_decode_in_a_child,
                                                        args=(encode(photo_like(40, 52), quality=90),))
    child.start()
    child.join(60)
    after = jpeg_roi.counts()
    assert child.exitcode == 0
    assert (after["decoded"] - before["decoded"], after["refused"] - before["refused"]) == (2, 1)


# jpeg_CreateDecompress as a libjpeg of another ABI answers the library's call: it refuses the struct size, through
# the caller's error_exit (a shim loaded before the library, so that the library binds to it).
REFUSING_CREATE = r"""
#include <dlfcn.h>
#include <stddef.h>
void jpeg_CreateDecompress(void *cinfo, int version, size_t structsize) {
  typedef void (*create)(void *, int, size_t);
  create real = (create)dlsym(dlopen(LIBJPEG, RTLD_NOW), "jpeg_CreateDecompress");
  real(cinfo, version, structsize + 1);
}
"""


def test_a_failure_creating_the_decompressor_is_refused_not_a_crash(tmp_path):
    """jpeg_create_decompress fails through error_exit (out of memory, a struct size or version it refuses): the
    call returns -1, as for any JPEG libjpeg refuses, where a longjmp to an escape not yet set crashed the process."""
    assert jpeg_roi.AVAILABLE, jpeg_roi.LIBRARY
    libjpeg, gcc = ctypes.util.find_library("jpeg"), shutil.which("gcc")
    if libjpeg is None or gcc is None:
        pytest.skip("needs gcc and libjpeg to build the shim")
    (tmp_path / "shim.c").write_text(REFUSING_CREATE)
    subprocess.run([gcc, "-shared", "-fPIC", f'-DLIBJPEG="{libjpeg}"', str(tmp_path / "shim.c"), "-o",
                    str(tmp_path / "shim.so"), "-ldl"], check=True, capture_output=True)
    script = (f"import ctypes\n"
              f"ctypes.CDLL({str(tmp_path / 'shim.so')!r}, mode=ctypes.RTLD_GLOBAL)\n"
              f"f = ctypes.CDLL({jpeg_roi.LIBRARY!r}).roi_decode_rgb\n"
              f"f.argtypes = [ctypes.c_char_p, ctypes.c_size_t, ctypes.c_void_p] + [ctypes.c_int] * 4\n"
              f"dst = ctypes.create_string_buffer(12)\n"
              f"print('rc', f(b'\\xff\\xd8\\xff\\xd9', 4, dst, 0, 0, 2, 2))\n")
    out = run_group([PY, "-c", script], timeout=60)
    assert (out.returncode, out.stdout.strip()) == (0, "rc -1"), out.stderr[-2000:]


def test_boxes_far_outside_the_image_are_refused():
    data = encode(photo_like(40, 52), quality=90)
    for i, j, h, w in [(0, 2**31 - 1, 1, 2**31 - 1), (2**31 - 1, 0, 2**31 - 1, 1), (0, 1, 1, 2**31 - 1),
                       (-2**31, 0, 5, 5), (0, 0, -5, -5), (0, 0, 41, 52), (0, 0, 40, 53)]:
        dst = np.zeros(12, np.uint8)
        assert jpeg_roi.roi_decode_rgb(data, len(data), dst.ctypes.data, j, i, w, h) == -2, (i, j, h, w)
        assert not dst.any()


def test_without_the_library_the_whole_decode_then_the_crop_and_one_warning(monkeypatch, caplog):
    data = encode(photo_like(75, 101), quality=90)
    full = decode_rgb_array(data, 75, 101)
    scratch = np.zeros(75 * 101 * 3, np.uint8)
    assert _decode_whole_box(np.frombuffer(data, np.uint8), scratch, scratch, 75, 101, 9, 13, 50, 70) == 0
    assert np.array_equal(scratch[:50 * 70 * 3].reshape(50, 70, 3), full[9:59, 13:83])
    # into a box-sized destination (a packed hand-over): the whole image in its own buffer, nothing past the box
    box, whole = np.zeros(50 * 70 * 3 + 64, np.uint8), np.zeros(75 * 101 * 3, np.uint8)
    assert _decode_whole_box(np.frombuffer(data, np.uint8), box, whole, 75, 101, 9, 13, 50, 70) == 0
    assert np.array_equal(box[:50 * 70 * 3].reshape(50, 70, 3), full[9:59, 13:83]) and not box[50 * 70 * 3:].any()
    cut = np.frombuffer(data[:len(data) // 2], np.uint8)  # decoded to its last row by turbojpeg, then refused
    box[:], whole[:] = 0, 0
    assert decode_rgb_box(cut, box, whole, 75, 101, 9, 13, 50, 70) == -1 and not box[50 * 70 * 3:].any()
    monkeypatch.setattr(jpeg_roi, "AVAILABLE", False)
    monkeypatch.setattr(jpeg_roi, "LIBRARY", "not built (a test)")
    monkeypatch.setattr(jpeg_roi, "_warned", False)
    assert jpeg_roi.decode_box(data, 0, 0, 4, 4) is None
    with caplog.at_level(logging.WARNING, logger="convit_scale.jpeg_roi"):
        assert not jpeg_roi.warn_if_missing("the test loader") and not jpeg_roi.warn_if_missing("the test loader")
    assert [r.getMessage() for r in caplog.records] == [
        "the test loader: decoding whole JPEGs, then cropping (same pixels, more CPU): not built (a test)"]


@pytest.mark.parametrize("on_device", [False, True], ids=["full recipe", "crop and flip"])
def test_webdataset_train_samples_are_unchanged(on_device, monkeypatch):
    """The WebDataset train path opens a JPEG's header and decodes its crop box alone: the same tensors as the whole
    decode, for every sample (greyscale, progressive, CMYK through PIL's whole decode), and the same replacement of
    a JPEG that cannot be decoded."""
    from convit_scale.config import DataConfig
    from convit_scale.data import wds
    from convit_scale.data.faults import next_good, pil_rgb
    from convit_scale.data.transforms import build_train_transform, image_opener

    pixels = photo_like(375, 500, seed=5)
    jpegs = [encode(pixels, quality=90), encode(pixels[:333, :499], "L", quality=85),
             encode(pixels, quality=80, progressive=True), encode(pixels[:200, :300], "CMYK", quality=90),
             encode(pixels[:240], quality=90, subsampling=1)[:700], encode(pixels[::2], quality=95, subsampling=0)]
    chunk = [("shard", f"k{n}", jpg, n, None) for n, jpg in enumerate(jpegs * 3)]
    transform = build_train_transform(DataConfig(), 64, on_device)
    assert image_opener(transform) is not pil_rgb

    def run():
        def replacement(i, failed):
            return wds._decodable(chunk[next_good(failed, i, len(chunk))])
        return wds.decode_chunk(chunk, list(range(100, 100 + len(chunk))), transform, replacement, "a test")

    before = jpeg_roi.counts()
    images, labels, bad = run()
    used = jpeg_roi.counts()["decoded"] - before["decoded"]
    monkeypatch.setattr(wds, "image_opener", lambda t: pil_rgb)  # as before: every image decoded whole
    ref_images, ref_labels, ref_bad = run()
    assert jpeg_roi.counts()["decoded"] - before["decoded"] == used >= 9  # the boxes of 3 x 3 JPEGs at least
    assert labels == ref_labels and [b["key"] for b in bad] == [b["key"] for b in ref_bad] == ["k4", "k10", "k16"]
    assert [b["reason"] for b in bad] == [b["reason"] for b in ref_bad]
    assert all(a.equal(b) for a, b in zip(images, ref_images, strict=True))


def _sample_photographs() -> dict[str, Path]:
    """scikit-learn's two photographs (china.jpg, flower.jpg, 640 x 427), read as files (importing sklearn.datasets
    would pull in SciPy); a skip where scikit-learn (the `bench` extra) is not installed."""
    import importlib.util

    spec = importlib.util.find_spec("sklearn")
    photos = {p.name: p for p in Path(spec.submodule_search_locations[0], "datasets", "images").glob("*.jpg")} \
        if spec else {}
    if sorted(photos) != ["china.jpg", "flower.jpg"]:
        pytest.skip("needs scikit-learn's sample photographs: pip install -e '.[bench]'")
    return photos


PHOTO_VARIANTS = {"as shipped": None, "4:2:0 q90": dict(quality=90, subsampling=2),
                  "4:2:2 q75": dict(quality=75, subsampling=1), "4:4:4 q95": dict(quality=95, subsampling=0)}


@pytest.mark.parametrize("variant", PHOTO_VARIANTS)
@pytest.mark.parametrize("photo", ["china.jpg", "flower.jpg"])
def test_real_photographs_box_is_the_whole_decode_cropped(photo, variant):
    """Photographs, not synthetic images: the file as shipped, and re-encoded by PIL at each chroma subsampling,
    whole (640 x 427: a height off the 16-row iMCU grid) and cut to an odd 499 x 333 off the grid in both
    directions; every box of ``boxes`` (edges, corners, 1x1, off-grid offsets, random and RandomResizedCrop
    boxes) is the whole decode's pixels, cropped."""
    assert jpeg_roi.AVAILABLE, jpeg_roi.LIBRARY
    shipped = _sample_photographs()[photo].read_bytes()
    pixels = np.asarray(Image.open(io.BytesIO(shipped)).convert("RGB"))
    save = PHOTO_VARIANTS[variant]
    cases = [shipped] if save is None else [encode(np.ascontiguousarray(cut), **save)
                                            for cut in (pixels, pixels[41:41 + 333, 77:77 + 499])]
    before = jpeg_roi.counts()
    tried = 0
    for data in cases:
        width, height = Image.open(io.BytesIO(data)).size
        full = decode_rgb_array(data, height, width)
        assert full is not None and np.array_equal(full, np.asarray(Image.open(io.BytesIO(data)).convert("RGB")))
        rng = np.random.default_rng(height + width + len(variant))
        sweep = boxes(height, width, rng, 60)
        wrong = [(i, j, h, w) for i, j, h, w in sweep
                 if not np.array_equal(jpeg_roi.decode_box(data, i, j, h, w), full[i:i + h, j:j + w])]
        assert wrong == [], (photo, variant, height, width)
        tried += len(sweep)
    after = jpeg_roi.counts()
    assert after["decoded"] - before["decoded"] == tried and after["refused"] == before["refused"]  # none refused
