"""``python -m convit_scale.bench KIND SPEC``: one benchmark candidate, measured in this fresh process.

KIND is model, data, distill, train (``bench mfu``) or inference; SPEC is its JSON; the result is the last line printed.
"""

from __future__ import annotations

import json
import sys

from . import data, distill, inference, mfu, model


def main() -> None:
    workers = {"model": model.worker, "data": data.worker, "distill": distill.worker, "train": mfu.worker,
               "inference": inference.worker}
    if len(sys.argv) != 3 or sys.argv[1] not in workers:
        raise SystemExit(f"usage: python -m convit_scale.bench KIND SPEC_JSON; KIND is one of {', '.join(workers)}")
    print(json.dumps(workers[sys.argv[1]](json.loads(sys.argv[2]))))


if __name__ == "__main__":
    main()
