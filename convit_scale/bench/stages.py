"""`bench data --stages` and `bench data --calibrate`: where a training loader's CPU time per image goes, as same-run
ratios to the decode of the whole JPEG, and this node's decode cost for `plan`.

One process, one core: the whole-JPEG decode (PIL, from memory) and one rank's train loader at one worker for each
format (FFCV, WebDataset) in each mode (``MODES``: where the stages after reading run), taking turns an epoch at a
time until each has run ``seconds``, so a machine whose speed drifts moves them alike. A loader's CPU time counts
from the arrival of its first batch to that of its last (the steady state: no thread start, no pipeline fill) over
the images of the batches after the first.

The stages are the differences between modes of the same run (each mode does one stage less than the one before):

| stage    | = mode - mode    | what it is                                                               |
| -------- | ---------------- | ------------------------------------------------------------------------ |
| read     | decode-on-device | reading the view, drawing its box from the header, handing it over       |
| decode   | box - read       | decoding the crop box alone (``jpeg_roi``)                               |
| resize   | pixels - box     | resizing the box to 224 on the CPU (PIL's bicubic)                       |
| augment  | cpu - pixels     | RandAugment, normalisation, random erasing on the CPU (timm's)           |

``--calibrate`` measures the decode alone, for a few seconds, and writes this node's figure where ``plan`` reads it
(``planner.calibration_path``): the loaders' costs there are these ratios times the node's decode.
"""

from __future__ import annotations

import io
import json
import os
import platform
import resource
import time
from pathlib import Path

import torch
from PIL import Image

from ..config import DataConfig
from ..data import LoaderSpec, build_loader

MODES = {"cpu": ("cpu", "pixels"), "pixels": ("device", "pixels"), "box": ("device", "box"),
         "decode-on-device": ("device", "jpeg")}
"""Plan and bench mode -> (data.augment_on, LoaderSpec.handover): ``cpu`` the whole augmentation in the loader;
``pixels`` the crop resized on the CPU (``data.resize_on: cpu``); ``box`` the box handed over at its own size
(``data.resize_on: device``, the GPU recipes' default); ``decode-on-device`` the JPEG handed over (``data.decode_on:
device``)."""
FORMATS = ("ffcv", "wds", "imagefolder")
"""ImageFolder decodes every file whole with PIL: no decode-on-device mode."""
BATCH = 64


def _cpu_s() -> float:
    own = resource.getrusage(resource.RUSAGE_SELF)
    return own.ru_utime + own.ru_stime


def decode_ms(blobs: list[bytes], seconds: float) -> tuple[float, int]:
    """CPU ms per image of PIL decoding whole JPEGs from memory, and the images decoded, for at least ``seconds``."""
    c0, n = _cpu_s(), 0
    while _cpu_s() - c0 < seconds or n < len(blobs):
        for b in blobs:
            Image.open(io.BytesIO(b)).convert("RGB").load()
            n += 1
    return 1000 * (_cpu_s() - c0) / n, n


def _modes(fmt: str) -> list[str]:
    return [m for m in MODES if not (fmt == "imagefolder" and m == "decode-on-device")]


def _loader(fmt: str, path: Path, mode: str):
    augment_on, handover = MODES[mode]
    d = DataConfig(format=fmt, train_path=str(path), val_path=str(path), num_workers=1 if fmt == "ffcv" else 0,
                   repeated_aug=1, augment_on=augment_on)
    loader = build_loader(d, LoaderSpec("train", 224, BATCH, augment_on_device=augment_on == "device",
                                        handover=handover))
    for _ in loader.epoch(99):  # warm-up: numba's compilation, the file cache
        break
    return loader


def _epoch_cpu(loader, epoch: int) -> tuple[float, int]:
    """CPU seconds from the first batch's arrival to the last's, and the images of the batches after the first."""
    c0, images = None, 0
    for batch in loader.epoch(epoch):
        if c0 is None:
            c0 = _cpu_s()
        else:
            images += len(batch.labels)
    return _cpu_s() - c0, images


def stage_costs(tree: Path, paths: dict, seconds: float) -> dict:
    """CPU ms per image of every format and mode, each as a ratio to the whole decode measured in the same rounds
    (module docstring): each round decodes the JPEGs once and runs an epoch of every loader that has not yet run
    ``seconds`` (and two epochs); the stages as differences of modes."""
    torch.set_num_threads(1)
    blobs = [f.read_bytes() for f in sorted(Path(tree, "train").rglob("*.JPEG"))]
    loaders = {(f, m): _loader(f, paths.get(f, tree), m) for f in FORMATS for m in _modes(f)}
    cpu, images, epochs = dict.fromkeys(loaders, 0.0), dict.fromkeys(loaders, 0), dict.fromkeys(loaders, 0)
    dec = {k: [0.0, 0] for k in loaders}  # the decode's CPU seconds and images in the rounds each loader ran
    epoch = 0
    while running := [k for k in loaders if cpu[k] < seconds or epochs[k] < 2]:
        ms, n = decode_ms(blobs, 0)
        for key in running:
            spent, counted = _epoch_cpu(loaders[key], epoch)
            cpu[key], images[key], epochs[key] = cpu[key] + spent, images[key] + counted, epochs[key] + 1
            dec[key][0], dec[key][1] = dec[key][0] + ms * n / 1000, dec[key][1] + n
        epoch += 1
    decode = 1000 * sum(v[0] for v in dec.values()) / sum(v[1] for v in dec.values())
    out = {"decode_cpu_ms_per_image": decode, "images_per_epoch": len(blobs), "rounds": epoch, "formats": {}}
    for f in FORMATS:
        ms = {m: 1000 * cpu[f, m] / images[f, m] for m in _modes(f)}
        read = ms.get("decode-on-device")  # ImageFolder: read and decoded whole, one stage
        stages = {"read": read, "decode": ms["box"] - (read or 0.0),
                  "resize": ms["pixels"] - ms["box"], "augment": ms["cpu"] - ms["pixels"]}
        out["formats"][f] = {"modes": {m: {"cpu_ms_per_image": v, "epochs": epochs[f, m],
                                           "vs_decode": v / (1000 * dec[f, m][0] / dec[f, m][1])}
                                       for m, v in ms.items()},
                             "stages_ms": stages}
    return out


def calibrate(tree: Path, seconds: float, out: Path) -> dict:
    """This node's whole-JPEG decode, CPU ms per image, written to ``out`` as JSON for ``plan``."""
    blobs = [f.read_bytes() for f in sorted(Path(tree, "train").rglob("*.JPEG"))]
    decode_ms(blobs[:8], 0)  # warm
    ms, n = decode_ms(blobs, seconds)
    record = {"decode_cpu_ms_per_image": ms, "images": n, "host": platform.node(), "cpu": _cpu_model(),
              "usable_cpus": len(os.sched_getaffinity(0)), "time": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
              "command": "convit-scale bench data --calibrate"}
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(out.name + ".tmp")
    tmp.write_text(json.dumps(record, indent=2) + "\n")
    tmp.replace(out)
    return record


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"
