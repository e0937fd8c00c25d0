"""`bench startup` (convit_scale/bench/startup.py): a process's start with the loaders' numba code compiled, and
loaded from numba's cache on disk; the draws' and resizes' cache itself (splitmix_numba.py, data/resample.py)."""


def test_a_new_process_loads_the_draws_and_resizes_from_numbas_cache(tmp_path):
    """`bench startup`, one round: a process with an empty cache folder compiles the crop and flip draws and the
    resizes, with the types the loaders pass (numba counts the misses), and fills the folder; the next loads every
    one of them from it (no miss)."""
    from convit_scale.bench.startup import STAGES, bench_startup

    res = bench_startup(tmp_path, rounds=1)
    rows = {r["case"]: r for r in res["rows"]}
    compiled, cached = rows["compiled"], rows["from the cache"]
    assert compiled["cached"] and cached["cached"]
    assert compiled["cache_misses"] >= 4 and compiled["cache_hits"] == 0, compiled
    assert cached["cache_misses"] == 0 and cached["cache_hits"] >= 4, cached
    assert all(compiled[f"{s}_vs_compiled"] == 1.0 and cached[f"{s}_s"] > 0 for s in STAGES)
    assert list(tmp_path.iterdir()) == []  # the cache folders are removed
