"""Run `python -m convit_scale.train` under torchrun with torch.distributed.all_reduce counted per training step;
each rank writes its counts to OUT/all_reduce_rank<R>.json (tests/test_engine_faults.py)."""

import json
import os
import sys
from pathlib import Path

import torch.distributed as dist

from convit_scale.train import loop
from convit_scale.train.__main__ import main

calls = [0]
per_step: list[int] = []
_all_reduce, _train_step = dist.all_reduce, loop.train_step


def counting_all_reduce(*args, **kwargs):
    calls[0] += 1
    return _all_reduce(*args, **kwargs)


def counted_step(run, state, micro_batches):
    before = calls[0]
    result = _train_step(run, state, micro_batches)
    per_step.append(calls[0] - before)
    return result


dist.all_reduce = counting_all_reduce
loop.train_step = counted_step
out = Path(sys.argv[1])
rc = main(sys.argv[2:])
(out / f"all_reduce_rank{os.environ.get('RANK', '0')}.json").write_text(json.dumps(per_step))
sys.exit(rc)
