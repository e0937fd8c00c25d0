"""``python -m convit_scale.bench KIND SPEC``: one benchmark candidate, measured in this fresh process.

KIND is model, data, distill, train (``bench mfu``), inference, gate or startup; SPEC is its JSON; the result is the
last line printed. Only KIND's module is imported (``data`` imports FFCV).
"""

from __future__ import annotations

import importlib
import json
import sys

WORKERS = {"model": "model", "data": "data", "distill": "distill", "train": "mfu", "inference": "inference",
           "gate": "gate", "startup": "startup"}
"""KIND -> the module of convit_scale.bench whose ``worker`` measures it."""


def main() -> None:
    if len(sys.argv) != 3 or sys.argv[1] not in WORKERS:
        raise SystemExit(f"usage: python -m convit_scale.bench KIND SPEC_JSON; KIND is one of {', '.join(WORKERS)}")
    worker = importlib.import_module(f"{__package__}.{WORKERS[sys.argv[1]]}").worker
    print(json.dumps(worker(json.loads(sys.argv[2]))))


if __name__ == "__main__":
    main()
