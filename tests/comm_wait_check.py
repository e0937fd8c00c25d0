"""Two ranks whose process group times out after 1.5 s; rank 0 works alone for 4 s (as it converts a checkpoint).

    python -m torch.distributed.run --nproc-per-node=2 tests/comm_wait_check.py OUT

Through ``comm.patient_group`` rank 1 receives rank 0's object after the 4 s; through the process group itself the
same wait fails on rank 1 (the defect the patient group exists for). Each rank writes OUT/rank<R>.json:
{"patient": the object received, or "error: ...", "default": the same for the process group's own wait}.
"""

import datetime
import json
import os
import sys
import time
from pathlib import Path

import torch.distributed as dist

from convit_scale import comm

WORK_S, TIMEOUT_S = 4.0, 1.5
out = Path(sys.argv[1])
dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=TIMEOUT_S))
rank, result = dist.get_rank(), {}
with comm.patient_group(60) as group:
    if rank == 0:
        time.sleep(WORK_S)
    try:
        result["patient"] = comm.broadcast_object("converted" if rank == 0 else None, group=group)
    except RuntimeError as e:
        result["patient"] = f"error: {e}"
t0 = time.time()
if rank == 0:
    time.sleep(WORK_S)
try:
    result["default"] = comm.broadcast_object("converted" if rank == 0 else None)
except RuntimeError as e:
    result["default"] = f"error after {time.time() - t0:.1f} s: {str(e)[:200]}"
(out / f"rank{rank}.json").write_text(json.dumps(result))
# Rank 1's wait timed out: torchrun ends every rank once one exits with an error, and tearing down a group after a
# timed-out collective may abort. Rank 1 waits for rank 0's result before both leave without the teardown.
if rank == 1:
    deadline = time.time() + 60
    while not (out / "rank0.json").is_file() and time.time() < deadline:
        time.sleep(0.1)
sys.stdout.flush()
os._exit(0)
