"""JPEG decoding as PIL decodes it, callable from FFCV's compiled stages and from Python.

timm's loaders (and the paper's) decode with PIL: libjpeg-turbo with its defaults, the accurate integer inverse
DCT and "fancy" (smooth) chroma upsampling. ffcv's own ``imdecode`` asks turbojpeg for ``TJFLAG_FASTDCT``, the fast
inverse DCT, which moves pixels by a level or more (BENCHMARKS.md, "FFCV against timm"). ``decode_rgb`` calls
turbojpeg, the library ffcv links, with no flags: libjpeg's defaults, so its pixels are PIL's, bit for bit
(``tests/test_jpeg.py``). A handle is made and freed per image (about 2 us; ffcv keeps one per thread in
thread-local storage, which compiled code cannot reach).

turbojpeg returns -1 for an error and also for a warning (a JPEG with extraneous bytes before a marker decodes,
with a warning): ``prep ffcv`` stores such an image as PIL decodes it instead of its bytes, so a loader never sees
one from a prepared file.

``decode_rgb_box`` decodes only a crop box (``jpeg_roi.py``), with the same pixels as ``decode_rgb`` then the crop.
"""

from __future__ import annotations

import ctypes
import ctypes.util

import numba
import numpy as np

from . import jpeg_roi


def _library() -> ctypes.CDLL:
    name = ctypes.util.find_library("turbojpeg") or "libturbojpeg.so.0"
    try:
        return ctypes.CDLL(name)
    except OSError as e:
        raise ImportError(f"libturbojpeg is not installed ({e}): FFCV needs it too; on Debian: apt-get install "
                          f"libturbojpeg0") from e


_lib = _library()
_init = _lib.tjInitDecompress
_init.restype, _init.argtypes = ctypes.c_void_p, []
_destroy = _lib.tjDestroy
_destroy.restype, _destroy.argtypes = ctypes.c_int, [ctypes.c_void_p]
_decompress = _lib.tjDecompress2  # (handle, jpeg, size, dst, width, pitch, height, pixel format, flags)
_decompress.restype = ctypes.c_int
_decompress.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_ulong, ctypes.c_void_p, ctypes.c_int, ctypes.c_int,
                        ctypes.c_int, ctypes.c_int, ctypes.c_int]

TJPF_RGB = 0
"""turbojpeg's pixel format: R, G, B bytes, rows packed (pitch 0 = width x 3)."""
LIBJPEG_DEFAULTS = 0
"""turbojpeg flags: none, so neither TJFLAG_FASTDCT nor TJFLAG_FASTUPSAMPLE: libjpeg's defaults, as PIL decodes."""


@numba.njit(nogil=True)
def decode_rgb(data, dst, height, width):
    """Decode the JPEG ``data`` (uint8, 1-D) into the first ``height x width x 3`` bytes of ``dst`` (contiguous
    uint8), as PIL decodes it. Returns 0, or -1 when turbojpeg refuses the data or warns about it."""
    handle = _init()
    rc = _decompress(handle, data.ctypes.data, data.size, dst.ctypes.data, width, 0, height, TJPF_RGB,
                     LIBJPEG_DEFAULTS)
    _destroy(handle)
    return rc


def decode_rgb_array(data: bytes, height: int, width: int) -> np.ndarray | None:
    """``decode_rgb`` from Python (no compilation): the (height, width, 3) pixels, or None where it returns -1."""
    src = np.frombuffer(data, dtype=np.uint8)
    out = np.empty((height, width, 3), dtype=np.uint8)
    handle = _init()
    try:
        rc = _decompress(handle, src.ctypes.data, src.size, out.ctypes.data, width, 0, height, TJPF_RGB,
                         LIBJPEG_DEFAULTS)
    finally:
        _destroy(handle)
    return out if rc == 0 else None


@numba.njit(nogil=True)
def _box_to(dst, whole, width, i, j, h, w):
    """Copy the ``h x w`` box at (``i``, ``j``) of the ``width``-wide RGB image in ``whole`` to the front of ``dst``,
    packed. ``whole`` may be ``dst`` itself: each byte moves to an offset no greater than its own, so a forward copy
    never overwrites what it has still to read."""
    for r in range(h):
        src, out = ((i + r) * width + j) * 3, r * w * 3
        if src != out or dst.ctypes.data != whole.ctypes.data:
            for k in range(w * 3):
                dst[out + k] = whole[src + k]


@numba.njit(nogil=True)
def _decode_whole_box(data, dst, whole, height, width, i, j, h, w):
    """The whole decode into ``whole``, then its box copied to the front of ``dst``. turbojpeg writes every row of
    ``whole`` even where it then refuses the file (a truncated JPEG: a warning, -1): ``whole`` holds the whole image,
    whatever ``dst`` holds."""
    rc = decode_rgb(data, whole, height, width)
    if rc == 0:
        _box_to(dst, whole, width, i, j, h, w)
    return rc


if jpeg_roi.AVAILABLE:
    _roi = jpeg_roi.roi_decode_rgb

    @numba.njit(nogil=True)
    def decode_rgb_box(data, dst, whole, height, width, i, j, h, w):
        """The ``h x w`` box at row ``i``, column ``j`` of the ``height x width`` JPEG ``data``, decoded into the first
        ``h x w x 3`` bytes of ``dst``, as ``decode_rgb`` then the crop give it; only the box is decoded
        (``jpeg_roi.py``). Where the crop-region decoder refuses the data, the whole decode into ``whole`` (``height
        x width x 3`` bytes; may be ``dst`` where ``dst`` holds the whole image) then the crop (which refuses it
        too: -1). Nothing is written to ``dst`` past the box."""
        if h == height and w == width:  # the whole image: turbojpeg's decode, nothing to skip
            return decode_rgb(data, dst, height, width)
        if _roi(data.ctypes.data, data.size, dst.ctypes.data, j, i, w, h) == 0:
            return 0
        return _decode_whole_box(data, dst, whole, height, width, i, j, h, w)
else:
    @numba.njit(nogil=True)
    def decode_rgb_box(data, dst, whole, height, width, i, j, h, w):
        """``decode_rgb`` into ``whole`` then the crop, packed at the front of ``dst`` (``jpeg_roi``'s library is
        not built)."""
        return _decode_whole_box(data, dst, whole, height, width, i, j, h, w)


def decode_rgb_box_array(data: bytes, height: int, width: int, i: int, j: int, h: int, w: int) -> np.ndarray | None:
    """``decode_rgb_box`` from Python, compiled: the (h, w, 3) box, or None where it returns -1."""
    out = np.empty(height * width * 3, np.uint8)
    rc = decode_rgb_box(np.frombuffer(data, np.uint8), out, out, height, width, i, j, h, w)
    return out[:h * w * 3].reshape(h, w, 3) if rc == 0 else None
