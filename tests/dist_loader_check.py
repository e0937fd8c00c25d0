"""Run under torchrun: one epoch (or a resumed part) of a loader per rank, results to JSON per rank, for each
FORMAT=PATH=OUT given (one launch for all of them).

    dist_loader_check.py WORKERS REPEATS FORMAT=PATH=OUT [FORMAT=PATH=OUT ...]
"""

import hashlib
import json
import sys
from pathlib import Path

import torch.distributed as dist

from convit_scale.config import DataConfig
from convit_scale.data import LoaderSpec, build_loader


def main(fmt: str, path: str, out: str, workers: int, repeats: int) -> None:
    rank, world = dist.get_rank(), dist.get_world_size()
    d = DataConfig(format=fmt, train_path=path, val_path=path, num_workers=workers, repeated_aug=repeats)
    result = {}
    for split, batch in (("train", 16), ("val", 24)):
        loader = build_loader(d, LoaderSpec(split, 32, batch, world, rank, seed=0))
        for epoch in (0, 1):
            labels, images, shapes = [], [], set()
            for x, y in loader.epoch(epoch):
                labels.append(y.tolist())
                images.append(_digest(x))
                shapes.add(tuple(x.shape[1:]))
            result[f"{split}{epoch}"] = {"batches": labels, "images": images, "len": len(loader),
                                         "num_real": loader.num_real, "shapes": sorted(shapes)}
        if split == "train":  # resume: batches from 5 on equal the uninterrupted epoch's, pixel for pixel
            part = list(loader.epoch(0, start_batch=5))
            result["resumed"] = [y.tolist() for _, y in part]
            result["resumed_images"] = [_digest(x) for x, _ in part]
    Path(out, f"rank{rank}.json").write_text(json.dumps(result))


def _digest(x) -> str:
    """The batch's pixels, bit for bit."""
    return hashlib.sha256(x.contiguous().numpy().tobytes()).hexdigest()


if __name__ == "__main__":
    dist.init_process_group("gloo")
    for case in sys.argv[3:]:
        main(*case.split("="), int(sys.argv[1]), int(sys.argv[2]))
        dist.barrier()
    dist.destroy_process_group()
