"""A pytest plugin for `make gpu-test` (``-p gpu_report``): one JSON file per group, GPU_TEST_OUT/group<N>.json, with
each test's outcome and seconds (and the reason of a skip or the end of a failure), the group's wall time, the
machine (GPU, torch, CUDA, DeepSpeed, Python) and the JSON files the tests wrote beside it: what BENCHMARKS.md's GPU
section is written from."""

from __future__ import annotations

import importlib.util
import json
import os
import platform
import time
from pathlib import Path

_results: list[dict] = []
_start = time.time()


def pytest_runtest_logreport(report) -> None:
    if report.when == "call" or (report.when == "setup" and report.outcome != "passed"):
        row = {"test": report.nodeid, "outcome": report.outcome, "seconds": round(report.duration, 2)}
        if report.outcome == "skipped" and isinstance(report.longrepr, tuple):
            row["reason"] = report.longrepr[2]
        elif report.outcome == "failed":
            row["error"] = str(report.longrepr)[-3000:]
        _results.append(row)


def _machine() -> dict:
    import torch

    out = {"python": platform.python_version(), "torch": torch.__version__, "cuda": torch.version.cuda,
           "gpus": [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]}
    if importlib.util.find_spec("deepspeed") is not None:
        from importlib.metadata import version

        out["deepspeed"] = version("deepspeed")
    return out


def pytest_sessionfinish(session, exitstatus) -> None:
    out = Path(os.environ.get("GPU_TEST_OUT", "runs/gpu-test"))
    out.mkdir(parents=True, exist_ok=True)
    group = os.environ.get("GPU_TEST_GROUP", "all")
    report = {"group": group, "exit_status": int(exitstatus), "wall_s": round(time.time() - _start, 1),
              "machine": _machine(), "tests": _results,
              "files": sorted(str(p.relative_to(out)) for p in out.rglob("*.json") if not p.name.startswith("group"))}
    (out / f"group{group}.json").write_text(json.dumps(report, indent=1))
