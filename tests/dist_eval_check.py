"""Run under torchrun: the evaluation of weights on an ImageFolder validation tree, sharded over the ranks (gloo),
its result to JSON per rank.

    dist_eval_check.py WEIGHTS DATA OUT
"""

import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist

from convit_scale.config import DataConfig
from convit_scale.data import LoaderSpec, build_loader
from convit_scale.evaluation import evaluate
from convit_scale.models import create_model


def main(weights: str, data: str, out: str) -> None:
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    model = create_model("convit_nano", num_classes=10)
    model.load_state_dict(torch.load(weights, weights_only=True))
    d = DataConfig(format="imagefolder", train_path=data, val_path=data, num_workers=1)
    loader = build_loader(d, LoaderSpec("val", 16, 16, world, rank))
    result = evaluate(model.eval(), loader, torch.device("cpu"), num_classes=10)
    Path(out, f"rank{rank}.json").write_text(json.dumps(result))
    dist.destroy_process_group()


if __name__ == "__main__":
    main(*sys.argv[1:4])
