"""`bench model` (convit_scale/bench/model.py): times and memory each read from a run of their own."""

from convit_scale.bench import model


def test_model_bench_reads_times_and_memory_from_their_own_runs(monkeypatch):
    """On CPU each candidate runs twice: images/s from a run with training's malloc, peak RSS from one with
    RSS_ENV; on CUDA (allocator statistics) once."""
    calls = []

    def fake_run(kind, spec, memory=False):
        calls.append((spec["model"], spec["device"], memory))
        return {"images_per_s": 1.0 if memory else 2.0, "peak_mb": 10.0 if memory else 99.0}

    monkeypatch.setattr(model, "run_worker", fake_run)
    out = model.bench_model(batch=1, steps=1, rounds=1, device="cpu", precision="fp32")
    assert all(r["images_per_s"] == 2.0 and r["peak_mb"] == 10.0 for r in out["results"].values())
    assert sorted(m for *_, m in calls) == [False] * len(model.CANDIDATES) + [True] * len(model.CANDIDATES)
    calls.clear()
    model.bench_model(batch=1, steps=1, rounds=1, device="cuda", precision="bf16")
    assert [m for *_, m in calls] == [False] * len(model.CANDIDATES)
