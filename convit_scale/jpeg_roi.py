"""Decode only the crop box of a JPEG, bit for bit as the whole decode then the crop (``_jpeg_roi.c``, with ctypes).

A RandomResizedCrop (scale 0.08-1) keeps about half of an image on average; decoding the whole image to throw the
rest away costs the inverse DCT, upsampling and colour conversion of every pixel. ``_jpeg_roi.c`` decodes only the
box's rows and the iMCU columns around it (libjpeg-turbo's jpeg_skip_scanlines and jpeg_crop_scanline, with the
margin fancy upsampling needs), stops after its last row, and copies the box out: the same pixels as turbojpeg's
whole decode (``jpeg.decode_rgb``) and PIL's, for baseline and progressive JPEGs, 4:2:0, 4:2:2, 4:4:4, 4:4:0,
4:1:1, greyscale, with restart markers (``tests/test_jpeg_roi.py``). ``convit-scale bench data --decode-only``
measures what it saves.

The library is built by ``pip install -e .`` (an optional extension in pyproject.toml: it needs gcc and libjpeg's
headers). A checkout run in place (``python -m`` from a source tree mounted into the container, whose image installed
the package) shadows the installed copy and has no library of its own: the installed distribution's library is
loaded then (``_candidates``). Without any, the loaders decode whole images, with the same pixels, and say so once
(``warn_if_missing``); a training run refuses to start that way unless ``data.whole_jpeg_decode`` asks for it
(``refusal``, called by the checks before training).
This module needs no numba: the WebDataset loader calls it from Python; ``jpeg.py`` calls it from compiled code.
"""

from __future__ import annotations

import ctypes
import importlib.machinery
import importlib.metadata
import logging
from pathlib import Path

import numpy as np

log = logging.getLogger(__name__)


def _installed() -> list[Path]:
    """The library of the installed convit-scale distribution (pip install ., a container's image), wherever the
    package itself was imported from: a checkout run in place shadows it. Every distribution of that name on the path
    is asked: the checkout's own metadata (the egg-info an editable install leaves in it) comes first and lists none."""
    files = [f for d in importlib.metadata.distributions(name="convit-scale") for f in d.files or []]
    return [Path(f.locate()) for f in files
            if f.parent.as_posix() == "convit_scale" and f.name.startswith("_jpeg_roi.") and f.suffix == ".so"]


def _candidates():
    """Where the library may be, in order: beside this module (this Python's extension name first; a plain C library,
    with no Python API, built for another Python loads as well), then the installed distribution's (looked for only
    when there is none beside the module)."""
    here = Path(__file__).parent
    names = [f"_jpeg_roi{suffix}" for suffix in importlib.machinery.EXTENSION_SUFFIXES]
    yield from [here / n for n in names] + sorted(here.glob("_jpeg_roi.*.so"))
    yield from _installed()


def _load() -> tuple[ctypes.CDLL | None, str]:
    """The library and its path, or None and why not."""
    for path in _candidates():
        if path.exists():
            try:
                return ctypes.CDLL(str(path)), str(path)
            except OSError as e:
                return None, f"{path} does not load ({e}); rebuild it with `make setup` or pip install -e ."
    return None, ("convit_scale/_jpeg_roi.c is not built here and no installed convit-scale has it (pip install -e . "
                  "builds it; it needs gcc and libjpeg's headers: apt-get install libjpeg-dev)")


_lib, LIBRARY = _load()
AVAILABLE = _lib is not None
"""Whether the crop-region decoder is there; ``LIBRARY`` is its path, or why it is not."""

if AVAILABLE:
    roi_decode_rgb = _lib.roi_decode_rgb  # (jpeg, size, dst, x, y, w, h) -> 0, -1 refused/warned, -2 bad box
    roi_decode_rgb.restype = ctypes.c_int
    roi_decode_rgb.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p, ctypes.c_int, ctypes.c_int,
                               ctypes.c_int, ctypes.c_int]
    _counts = _lib.roi_decode_counts
    _counts.restype, _counts.argtypes = None, [ctypes.c_void_p]
    # The counters in a shared page (the library's roi_decode_share_counts): the loader workers this process forks
    # count into it, so that ``counts`` here is the rank's (a worker started by spawn imports this module anew and
    # counts apart).
    SHARED_COUNTS = hasattr(_lib, "roi_decode_share_counts") and _lib.roi_decode_share_counts() == 0
    if not SHARED_COUNTS:
        log.warning("%s counts per process (built before its counters were shared, or mmap failed): the training "
                    "log's crop counts leave out the loader workers' decodes; rebuild it with `make setup` or pip "
                    "install -e .", LIBRARY)
else:
    SHARED_COUNTS = False

_warned = False


def warn_if_missing(where: str) -> bool:
    """Log once per process why ``where`` decodes whole images; True when the library is there."""
    global _warned
    if not AVAILABLE and not _warned:
        _warned = True
        log.warning("%s: decoding whole JPEGs, then cropping (same pixels, more CPU): %s", where, LIBRARY)
    return AVAILABLE


def refusal(fmt: str, decode_on: str, whole_decode: bool) -> str | None:
    """Why a training run must not start (the checks before training raise it), or None: the train crops of FFCV and
    WebDataset decoded on the CPU need the library, unless ``data.whole_jpeg_decode`` accepts whole decodes."""
    if AVAILABLE or whole_decode or fmt not in ("ffcv", "wds") or decode_on != "cpu":
        return None
    return (f"data.whole_jpeg_decode = false: the crop-region JPEG decoder is missing ({LIBRARY}); every rank would "
            f"decode whole JPEGs (the same pixels, more CPU per image): build it, or set data.whole_jpeg_decode=true")


def counts() -> dict:
    """This process's crop-region decodes since the module was imported, its forked loader workers' included:
    ``decoded`` boxes and ``refused`` JPEGs (then decoded whole by the caller, or failed as the whole decode fails),
    and the library's path (or why there is none)."""
    out = np.zeros(2, np.uint64)
    if AVAILABLE:
        _counts(out.ctypes.data)
    return {"decoded": int(out[0]), "refused": int(out[1]), "library": LIBRARY}


def decode_box(data: bytes, i: int, j: int, h: int, w: int) -> np.ndarray | None:
    """The ``h x w`` box at row ``i``, column ``j`` of the JPEG ``data`` as (h, w, 3) RGB uint8, or None where the
    library is missing or refuses the data (decode it whole: the box must lie inside the image)."""
    if not AVAILABLE:
        return None
    out = np.empty((h, w, 3), np.uint8)
    rc = roi_decode_rgb(data, len(data), out.ctypes.data, j, i, w, h)
    if rc == -2:
        raise ValueError(f"crop box (top {i}, left {j}, {h} x {w}) outside the image")
    return out if rc == 0 else None
