"""`bench startup`: what a training process pays at its start for the loaders' compiled code (numba), compiled and
loaded from numba's cache on disk. Every rank of a job pays it, at every start and requeue, before its first step.

Each measurement is a fresh process (``python -m convit_scale.bench startup SPEC``) whose ``NUMBA_CACHE_DIR`` is an
empty folder ("compiled") or the folder the first round's compiled process filled ("from the cache"), in
interleaved rounds; the best round of each is kept. Each reports numba's own count of the functions it compiled
(``cache_misses``) and loaded (``cache_hits``). Its stages, in the order a training process meets them:

- ``start``: the rest of the process, as its caller times it: the interpreter, the imports (torch, numba, the data
  modules) and its exit, the same in both cases;
- ``draws``: ``sample.compile_draws``, which the train transform calls before loader workers fork (a view's crop box
  and flip, ``splitmix_numba.py``);
- ``resize``: the first train crop's and eval view's resize (``resample.resized_crop``, ``resized_center_crop``), called
  as the FFCV decoders' compiled pipeline calls them (the rest of that pipeline, compiled by FFCV, is not cached and
  not measured here).
"""

from __future__ import annotations

import tempfile
import time
from pathlib import Path

import numba
import numpy as np

from ..data import resample, sample
from ..splitmix_numba import CACHE
from .worker import run_worker

STAGES = ("start", "draws", "resize")
CASES = ("compiled", "from the cache")


def worker(spec: dict) -> dict:
    """This process's compiled stages, in seconds (``NUMBA_CACHE_DIR`` set by the caller), and whether numba cached
    them."""
    t1 = time.perf_counter()
    sample.compile_draws()
    t2 = time.perf_counter()
    size, kind = spec.get("size", 224), resample.FILTERS["bicubic"]
    short_side = resample.eval_short_side(size, 0.875)

    @numba.njit
    def first_views(src, height, width, dst, mid):
        # as the FFCV decoders call them (data/ffcv_decoders.py): the filter and the eval side are constants of the
        # compiled stage, the box is not; the same specialisations, so the same cache entries
        resample.resized_crop(src, width, 0, 0, height, width, dst, kind, mid)
        resample.resized_center_crop(src, height, width, short_side, dst, kind, mid)

    first_views(np.zeros(2 * size * 2 * size * 3, np.uint8), 2 * size, 2 * size, np.empty((size, size, 3), np.uint8),
                np.empty(2 * size * size * 3, np.uint8))
    t3 = time.perf_counter()
    stats = [f.stats for f in (sample.seeded_crop, sample.flipped, resample.resized_crop,
                               resample.resized_center_crop)]
    return {"draws": t2 - t1, "resize": t3 - t2, "cached": CACHE,
            "cache_hits": sum(sum(s.cache_hits.values()) for s in stats),
            "cache_misses": sum(sum(s.cache_misses.values()) for s in stats)}


def _measure(cache_dir: Path) -> dict:
    """One fresh process with ``cache_dir`` as numba's cache: its stages, ``start`` being its wall-clock as timed
    here less the stages it timed itself."""
    t0 = time.perf_counter()
    got = run_worker("startup", {}, env={"NUMBA_CACHE_DIR": str(cache_dir)})
    got["start"] = time.perf_counter() - t0 - got["draws"] - got["resize"]
    return got


def bench_startup(work: Path, rounds: int) -> dict:
    """Per case, the best round's stages (the sum of the compiled ones is the best round's: stages of one process);
    each stage and the total against the compiled case of the same run."""
    work.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=work) as tmp:
        best: dict[str, dict] = {}
        for r in range(rounds):
            for case in CASES:  # round 0's compiled process fills the cache of every "from the cache" one
                got = _measure(Path(tmp) / ("cold0" if case == "from the cache" else f"cold{r}"))
                got["total"] = sum(got[s] for s in STAGES)
                if case not in best or got["total"] < best[case]["total"]:
                    best[case] = got
    base = best["compiled"]
    rows = [{"case": case, **{k: best[case][k] for k in ("cached", "cache_hits", "cache_misses")},
             **{f"{s}_s": round(best[case][s], 4) for s in (*STAGES, "total")},
             **{f"{s}_vs_compiled": round(best[case][s] / base[s], 4) for s in (*STAGES, "total")}} for case in CASES]
    return {"rounds": rounds, "stages": list(STAGES), "rows": rows}
