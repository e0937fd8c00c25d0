"""Several recipes one after another in one launch of N ranks: one interpreter start and one process group per
rank for all of them (``support.run_many``). The runs are the engine's own (``exit_status``), which leaves a
process group it did not start to its caller.

    python -m torch.distributed.run --nproc-per-node=N tests/rank_runs.py PLAN.json

PLAN.json: [{"recipe": PATH, "overrides": [...], "env": {...}}, ...]; each rank writes the exit status of every run
to PLAN.json's folder as statuses_rank<R>.json, after each run, so that the runs before a launch that died keep
theirs. A run that raises is recorded as "error: <type>: <message>" and the next one starts (every rank raises the
same way for what a run refuses; a rank that fails alone leaves the others in a collective, which the group's
timeout ends).
"""

import datetime
import json
import os
import sys
import time
import traceback
from pathlib import Path

import torch.distributed as dist

from convit_scale.config import load_config
from convit_scale.train.engine import exit_status

plan_file = Path(sys.argv[1])
dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=300))
statuses = []
for run in json.loads(plan_file.read_text()):
    saved = {k: os.environ.get(k) for k in run.get("env", {})}
    os.environ.update(run.get("env", {}))  # fault injection is read at set-up
    t0 = time.perf_counter()
    try:
        statuses.append(exit_status(load_config(run["recipe"], run.get("overrides", []))))
    except Exception as e:  # noqa: BLE001 - recorded for the test of this run; the next run starts
        traceback.print_exc()
        statuses.append(f"error: {type(e).__name__}: {e}")
    finally:
        for k, v in saved.items():
            os.environ.pop(k, None) if v is None else os.environ.__setitem__(k, v)
    (plan_file.parent / f"statuses_rank{dist.get_rank()}.json").write_text(json.dumps(statuses))
    dist.barrier()
    if dist.get_rank() == 0:  # where a shared launch's time goes
        print(f"rank_runs: {Path(run['recipe']).stem} took {time.perf_counter() - t0:.1f} s (status {statuses[-1]})",
              flush=True)
dist.destroy_process_group()
