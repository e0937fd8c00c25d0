"""`bench saves` (convit_scale/bench/saves.py): the same run not saving, saving at once and beside training."""


def test_saves_bench_runs_each_variant_and_counts_its_saves(tmp_path):
    """At test size on 1 rank (in this process): 5 steps, a save every 2 steps (steps 2 and 4; 5 is the end's), each
    variant's wall-clock against the run without saves."""
    from convit_scale.bench.saves import bench_saves

    res = bench_saves(tmp_path, "convit_nano", 28, 1, ["ddp"], 5, 2, 1)
    rows = {r["variant"]: r for r in res["rows"]}
    assert set(rows) == {"no saves", "saves at once", "saves beside training"}
    assert all(r["rc"] == 0 for r in rows.values()), rows
    assert rows["no saves"]["saves"] == 0 and rows["no saves"]["wall_vs_no_saves"] == 1.0
    assert rows["saves at once"]["saves"] == rows["saves beside training"]["saves"] == 2
    assert rows["saves beside training"]["save_s"] is not None and rows["saves beside training"]["wall_s"] > 0
