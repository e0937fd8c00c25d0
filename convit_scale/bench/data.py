"""`bench data`: loader throughput per core (ImageFolder, WebDataset, FFCV) against raw JPEG decode."""

from __future__ import annotations

import time
from pathlib import Path

import torch

from .worker import run_worker


def make_photo_tree(out: Path, per_class: int = 40, classes: int = 4, seed: int = 0) -> Path:
    """ImageNet-like JPEGs (about 500x375, q90) cut from the two real photographs scikit-learn ships."""
    import numpy as np
    from PIL import Image

    try:
        from sklearn.datasets import load_sample_images
    except ImportError as e:
        raise SystemExit("error: `bench data` needs scikit-learn's sample photographs: pip install -e '.[bench]'") from e
    photos = [Image.fromarray(a) for a in load_sample_images().images]  # 640x427 each
    rng = np.random.default_rng(seed)
    for split, n in (("train", per_class), ("val", max(4, per_class // 4))):
        for c in range(classes):
            d = out / split / f"c{c}"
            d.mkdir(parents=True, exist_ok=True)
            for i in range(n):
                p = photos[(c + i) % 2]
                w, h = int(rng.integers(420, 640)), int(rng.integers(300, 427))
                x0, y0 = int(rng.integers(0, 640 - w + 1)), int(rng.integers(0, 427 - h + 1))
                img = p.crop((x0, y0, x0 + w, y0 + h)).resize((500, 375), Image.BICUBIC)
                if i % 2:
                    img = img.transpose(Image.FLIP_LEFT_RIGHT)
                img.save(d / f"{i:04d}.JPEG", quality=90)
    return out


def _decode_rate(tree: str, seconds: float) -> float:
    """Images/s of PIL decoding the tree's training JPEGs from memory: the floor every loader pays."""
    import io

    from PIL import Image

    blobs = [f.read_bytes() for f in sorted(Path(tree, "train").rglob("*.JPEG"))]
    t0 = time.perf_counter()
    n = 0
    while time.perf_counter() - t0 < seconds:
        for b in blobs:
            Image.open(io.BytesIO(b)).convert("RGB").load()
            n += 1
    return n / (time.perf_counter() - t0)


def worker(spec: dict) -> dict:
    """Images/s of one loader on one core (workers 0: everything in this process), or of raw decode."""
    torch.set_num_threads(1)
    if spec["loader"] == "decode":
        return {"images_per_s": _decode_rate(spec["tree"], spec["seconds"])}
    from ..config import DataConfig
    from ..data import LoaderSpec, build_loader

    full = spec["transform"] == "full"
    d = DataConfig(format=spec["loader"], train_path=spec["path"], val_path=spec["path"], num_workers=0,
                   repeated_aug=1, rand_augment="rand-m9-mstd0.5-inc1" if full else None,
                   color_jitter=0.4 if full else 0.0, reprob=0.25 if full else 0.0)
    if spec["loader"] == "ffcv":
        d.num_workers = 1  # FFCV decodes in its own thread pool: one thread
    loader = build_loader(d, LoaderSpec("train", 224, 16))
    n, epoch = 0, 0
    for _ in loader.epoch(99):  # warm-up: numba compilation, file cache
        break
    t0 = time.perf_counter()
    while time.perf_counter() - t0 < spec["seconds"]:
        for x, _ in loader.epoch(epoch):
            n += len(x)
        epoch += 1
    return {"images_per_s": n / (time.perf_counter() - t0)}


def bench_data(work: Path, seconds: float, rounds: int) -> dict:
    from data_prep import PrepOptions, prepare

    tree = make_photo_tree(work / "tree")
    paths = {"imagefolder": tree, "wds": work / "wds", "ffcv": work / "ffcv"}
    prepare(tree, paths["wds"], PrepOptions(fmt="wds", shard_size=40, workers=2))
    prepare(tree, paths["ffcv"], PrepOptions(fmt="ffcv", workers=2))
    cands = [("decode", None)] + [(l, t) for l in ("imagefolder", "wds", "ffcv") for t in ("crop_flip", "full")]
    best: dict[str, float] = {}
    for _ in range(rounds):
        for loader, transform in cands:
            key = loader if transform is None else f"{loader}/{transform}"
            r = run_worker("data", {"loader": loader, "transform": transform, "tree": str(tree),
                                    "path": str(paths.get(loader, tree)), "seconds": seconds})
            best[key] = max(best.get(key, 0.0), r["images_per_s"])
    raw = best["decode"]
    return {"seconds": seconds, "rounds": rounds,
            "results": {k: {"images_per_s": v, "vs_raw_decode": v / raw} for k, v in best.items()}}
