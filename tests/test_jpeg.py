"""The FFCV loader's JPEG decode is PIL's, bit for bit (what timm's loaders and the paper's see)."""

import io

import numpy as np
import pytest
from PIL import Image

from convit_scale.jpeg import decode_rgb, decode_rgb_array


def photo_like(height: int, width: int, seed: int = 0) -> np.ndarray:
    """An image with what JPEG finds hard in photographs: smooth shading, sharp coloured edges, fine noise."""
    rng = np.random.default_rng(seed)
    yy, xx = np.mgrid[0:height, 0:width]
    img = np.stack([128 + 90 * np.sin(xx / (7 + 5 * c) + yy / (11 + 3 * c)) for c in range(3)], -1)
    for _ in range(6):
        y0, x0 = rng.integers(0, height - 4), rng.integers(0, width - 4)
        img[y0:y0 + rng.integers(3, height // 2), x0:x0 + rng.integers(3, width // 2)] = rng.integers(0, 256, 3)
    img += rng.normal(0, 12, img.shape)
    return np.clip(img, 0, 255).astype(np.uint8)


def encode(pixels: np.ndarray, mode: str = "RGB", **save) -> bytes:
    buf = io.BytesIO()
    Image.fromarray(pixels).convert(mode).save(buf, "JPEG", **save)
    return buf.getvalue()


def with_warning() -> bytes:
    """A JPEG that PIL reads and libjpeg warns about ("extraneous bytes before marker 0xd9")."""
    noise = (np.random.default_rng(0).random((90, 120, 3)) * 255).astype(np.uint8)
    data = encode(noise, quality=90)
    return data[:-2] + b"\x00\x11\x22" + data[-2:]


VARIANTS = {
    "4:2:0 q90": dict(quality=90, subsampling=2),
    "4:2:2 q75": dict(quality=75, subsampling=1),
    "4:4:4 q95": dict(quality=95, subsampling=0),
    "4:2:0 q100": dict(quality=100, subsampling=2),
    "progressive": dict(quality=85, progressive=True),
    "restart markers": dict(quality=90, restart_marker_rows=1),
}


@pytest.mark.parametrize("variant", VARIANTS)
def test_decode_is_pils_exactly(variant):
    data = encode(photo_like(75, 101), **VARIANTS[variant])  # odd sizes: partial MCUs at both edges
    ref = np.asarray(Image.open(io.BytesIO(data)).convert("RGB"))
    assert np.array_equal(decode_rgb_array(data, *ref.shape[:2]), ref)
    out = np.zeros(ref.size + 7, np.uint8)  # the compiled one, into a larger buffer (the FFCV scratch row)
    assert decode_rgb(np.frombuffer(data, np.uint8), out, ref.shape[0], ref.shape[1]) == 0
    assert np.array_equal(out[:ref.size].reshape(ref.shape), ref) and not out[ref.size:].any()


def test_greyscale_decodes_as_pil_converts_it_and_cmyk_or_junk_is_refused():
    grey = encode(photo_like(40, 52), "L", quality=90)
    ref = np.asarray(Image.open(io.BytesIO(grey)).convert("RGB"))
    assert np.array_equal(decode_rgb_array(grey, 40, 52), ref)
    assert decode_rgb_array(encode(photo_like(40, 52), "CMYK", quality=90), 40, 52) is None  # prep stores it raw
    warned = with_warning()
    assert Image.open(io.BytesIO(warned)).convert("RGB").size == (120, 90)  # PIL reads it
    assert decode_rgb_array(warned, 90, 120) is None  # turbojpeg decodes it with a warning, and returns -1
    assert decode_rgb_array(b"not a jpeg", 40, 52) is None
