"""NCCL's flight recorder on and off, one process per setting (torch reads the recorder's size once per process): DDP
steps of convit_nano on one GPU, each with the step's packed all-reduce read by the host, then small all-reduces
alone. ``python tests/nccl_trace_cost.py ENTRIES OUT.json``; tests/test_gpu.py runs it twice (group 3) and writes the
ratio for BENCHMARKS.md. Prints nothing: the JSON holds the medians and the collectives the recorder kept."""

from __future__ import annotations

import json
import pickle
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
from support import built_strategy, one_rank_group, strategy_step

from convit_scale import comm
from convit_scale.train.distributed import set_flight_recorder
from convit_scale.train.watchdog import dump_flight_recorder

STEPS, WARMUP, COLLECTIVES = 200, 10, 1000


def _median_ms(fn, times: int) -> float:
    """The median of ``times`` calls of ``fn``, each ended by a host read of the device (as the step's reduction)."""
    out = []
    for _ in range(times):
        t0 = time.perf_counter()
        fn()
        out.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(out)


def _recorded(path: Path) -> list[str]:
    """The collectives the flight recorder kept (empty when it is off)."""
    if dump_flight_recorder(path) != str(path):
        return []
    return [str(e.get("profiling_name", "")) for e in pickle.loads(path.read_bytes()).get("entries", [])]


def main(entries: int, out: Path) -> None:
    set_flight_recorder(entries)  # as engine.train does before the process group forms
    device = torch.device("cuda")
    with one_rank_group(device):
        strategy = built_strategy(device, "parallel.strategy=ddp", micro_batch=64)
        packed = torch.zeros(7, dtype=torch.float64, device=device)

        def step():
            strategy_step(strategy, device, batch=64)
            comm.all_reduce(packed).tolist()  # the step's one reduction and host read

        small = torch.ones(1024, device=device)

        def collectives():
            for _ in range(100):
                dist.all_reduce(small)
            small[0].item()

        _median_ms(step, WARMUP)
        step_ms = _median_ms(step, STEPS)
        collectives()
        per_collective_us = _median_ms(collectives, COLLECTIVES // 100) * 1e3 / 100
        with tempfile.TemporaryDirectory() as tmp:
            names = _recorded(Path(tmp) / "trace.pkl")
        strategy.close()
    out.write_text(json.dumps({"entries": entries, "step_ms": round(step_ms, 4),
                               "per_collective_us": round(per_collective_us, 2), "recorded": len(names),
                               "names": sorted(set(names)), "torch": torch.__version__}))


if __name__ == "__main__":
    main(int(sys.argv[1]), Path(sys.argv[2]))
