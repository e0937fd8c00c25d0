"""One FFCV .beton per split through ffcv's ``DatasetWriter`` (fields ``image``, an RGBImageField, and ``label``, an
IntField, as ffcv-imagenet writes them), in sorted (class, file) order, written under a temporary name and renamed
when complete. ``write_mode: keep`` stores each JPEG's own bytes where the loader's decoder gives PIL's pixels from
them (the check phase decided which)."""

from __future__ import annotations

import contextlib
import io
import json
import time
from pathlib import Path

import numpy as np
from PIL import Image

from convit_scale.ffcv_threads import importing_ffcv
from convit_scale.files import atomic_path, write_json_atomic
from convit_scale.imagetree import PrepError, Sample

from .checks import KEPT, RAW, class_counts, progress_bar, sha256_file
from .options import PrepOptions
from .sources import load_rgb_jpeg, read_bytes


class _RGBDataset:
    """Map-style (PIL RGB image, label) over checked samples, for ffcv's own write modes."""

    def __init__(self, samples: list[Sample]):
        self.samples = samples

    def __len__(self) -> int:
        return len(self.samples)

    def __getitem__(self, i: int):
        data, reason, _ = load_rgb_jpeg(self.samples[i].path)
        if data is None:
            raise PrepError(f"{self.samples[i].path}: {reason} (the file changed during conversion)")
        return Image.open(io.BytesIO(data)).convert("RGB"), self.samples[i].label


class _KeptDataset:
    """Map-style ((ffcv mode, height, width, bytes), label) for ``write_mode: keep``, by the check's decision."""

    def __init__(self, samples: list[Sample], storage: dict[str, str], opts: PrepOptions):
        self.samples, self.storage, self.opts = samples, storage, opts

    def __len__(self) -> int:
        return len(self.samples)

    def __getitem__(self, i: int):
        path, label = self.samples[i].path, self.samples[i].label
        data = read_bytes(path)
        how = self.storage[path]
        try:
            with Image.open(io.BytesIO(data)) as img:
                if how == KEPT:
                    return ("jpg", img.size[1], img.size[0], np.frombuffer(data, dtype=np.uint8)), label
                pixels = np.asarray(img.convert("RGB"))
        except (OSError, SyntaxError, ValueError) as e:
            raise PrepError(f"{path}: undecodable: {type(e).__name__}: {e} (the file changed during conversion)") from e
        if how == RAW:
            return ("raw", *pixels.shape[:2], np.ascontiguousarray(pixels).reshape(-1)), label

        with importing_ffcv():
            from ffcv.fields.rgb_image import encode_jpeg, resizer

        pixels = resizer(pixels, self.opts.max_resolution)
        return ("jpg", *pixels.shape[:2], encode_jpeg(pixels, self.opts.jpeg_quality)), label


def _encode_prepared(destination, image, malloc) -> None:
    """The image field's ``encode`` for ``write_mode: keep``: the bytes ``_KeptDataset`` prepared, as they are."""

    with importing_ffcv():
        from ffcv.fields.rgb_image import IMAGE_MODES

    mode, height, width, payload = image
    destination["mode"] = IMAGE_MODES[mode]
    destination["height"], destination["width"] = height, width
    destination["data_ptr"], storage = malloc(payload.nbytes)
    storage[:] = payload


def _image_field(opts: PrepOptions):
    """ffcv's RGBImageField; for ``keep``, one whose ``encode`` stores ``_KeptDataset``'s bytes. ffcv records a
    field's type by its exact class (``TYPE_ID_HANDLER``), so the field stays an RGBImageField, read back by any
    ffcv, and only this instance's encode is replaced (a module function: it reaches the writer's processes)."""

    with importing_ffcv():
        from ffcv.fields import RGBImageField

    if opts.write_mode != "keep":
        return RGBImageField(write_mode=opts.write_mode, max_resolution=opts.max_resolution,
                             jpeg_quality=opts.jpeg_quality)
    field = RGBImageField(write_mode="jpg")
    field.encode = _encode_prepared
    return field


def beton_name(split: str, opts: PrepOptions) -> str:
    """The .beton's name, by its parameters (ffcv-imagenet's train_256_0.5_90.ffcv)."""
    side = opts.max_resolution or "full"
    return f"{split}_{side}_{opts.write_mode}_q{opts.jpeg_quality}_f{opts.subset_fraction:g}.beton"


@contextlib.contextmanager
def _rich_progress(split: str):
    """ffcv's ``DatasetWriter`` draws its own tqdm bar (``ffcv.writer.tqdm``: ``update(n)``, ``close()``, its only
    report of progress); while it writes, that bar is prep's rich one (``progress_bar``), one style in a run."""
    import ffcv.writer as ffcv_writer

    with progress_bar() as progress:
        t0 = time.time()

        class Bar:
            def __init__(self, total: int):
                self.task, self.done = progress.add_task(f"ffcv {split}", total=total, rate=""), 0

            def update(self, n: int) -> None:
                self.done += n
                progress.update(self.task, advance=n, rate=f"{self.done / max(time.time() - t0, 1e-9):.0f}")

            def close(self) -> None:
                pass

        saved, ffcv_writer.tqdm = ffcv_writer.tqdm, Bar
        try:
            yield
        finally:
            ffcv_writer.tqdm = saved


def write_ffcv(samples: list[Sample], out: Path, split: str, opts: PrepOptions, key: str,
                storage: dict[str, str]) -> dict[str, dict]:
    with importing_ffcv():
        from ffcv.fields import IntField
        from ffcv.writer import DatasetWriter

    name = beton_name(split, opts)
    final = out / name
    state_file = out / f".state-{split}.json"
    state = json.loads(state_file.read_text()) if state_file.is_file() else {}
    per_class = class_counts([s.label for s in samples])
    if state.get("key") == key and name in state.get("done", {}) and final.is_file():
        return {name: {"samples": len(samples), "sha256": state["done"][name], "per_class": per_class}}
    print(f"ffcv {split}: writing {len(samples)} images to {final}")
    with atomic_path(final) as tmp, _rich_progress(split):
        writer = DatasetWriter(str(tmp), {"image": _image_field(opts), "label": IntField()}, num_workers=opts.workers)
        writer.from_indexed_dataset(_KeptDataset(samples, storage, opts) if opts.write_mode == "keep"
                                    else _RGBDataset(samples))
    sha = sha256_file(final)
    write_json_atomic(state_file, {"key": key, "done": {name: sha}})
    return {name: {"samples": len(samples), "sha256": sha, "per_class": per_class}}
