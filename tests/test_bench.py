"""The benchmarks' shared pieces: the GPU table, the timed step, distillation through the training loss,
and the ZeRO sizes `bench memory` pins."""

import math

import pytest
import torch
import torch.nn.functional as F

from convit_scale import planner
from convit_scale.bench import distill, memory, model, worker
from convit_scale.config import load_config
from convit_scale.hardware import GPUS, peak_tflops_of
from convit_scale.parallel.zero_config import deepspeed_config
from convit_scale.train.loss import DistillLoss


def test_one_gpu_table_for_planner_and_mfu():
    assert planner.GPUS is GPUS
    assert peak_tflops_of("NVIDIA H200") == GPUS["h200-141gb"].peak_tflops == 989
    assert peak_tflops_of("NVIDIA GH200 480GB") == GPUS["gh200-96gb"].peak_tflops
    assert peak_tflops_of("NVIDIA A100-SXM4-80GB") == 312  # not the A10 inside "A100"
    assert peak_tflops_of("NVIDIA A10") == 125 and peak_tflops_of("NVIDIA L40S") == 362
    assert peak_tflops_of("Some Future GPU") is None


def test_timed_step_measures_a_training_step():
    """In a fresh worker, as `bench model` runs it: in this long-lived process freed heap is reused, the step adds
    nothing to the RSS and its peak is 0 give or take the kernel's approximate page counts (-0.03 MB was seen)."""
    spec = {"model": ["convit_nano", "fast"], "batch": 2, "img_size": 16, "steps": 2, "warmup": 1,
            "device": "cpu", "precision": "fp32"}
    r = worker.run_worker("model", spec, memory=True)
    assert r["images_per_s"] > 0 and r["peak_mb"] > 1  # what build loads and makes: about 25 MB


def test_distill_bench_steps_with_the_training_loss():
    """`bench distill` times DistillLoss itself: hard distillation, alpha 0.5, teacher without gradients."""
    spec = {"student": "convit_nano", "teacher": "resnet18", "batch": 3, "img_size": 16, "steps": 1, "warmup": 1,
            "device": "cpu", "precision": "fp32"}
    w = distill.build(spec, torch.device("cpu"))
    assert isinstance(w.loss, DistillLoss) and w.optimizer is None
    assert not any(p.requires_grad for p in w.loss.teacher.parameters())
    x, y = torch.randn(3, 3, 16, 16), torch.tensor([0, 1, 2])
    logits = w.model(x)
    with torch.no_grad():
        hard = w.loss.teacher(x).argmax(1)
    expected = 0.5 * F.cross_entropy(logits, y) + 0.5 * F.cross_entropy(logits, hard)
    assert torch.allclose(w.loss(x, logits, y), expected)
    assert distill.build({**spec, "teacher": None}, torch.device("cpu")).loss is None
    assert worker.timed_step(spec, distill.build)["images_per_s"] > 0


@pytest.mark.parametrize("strategy", ["ddp", "zero1", "zero2", "zero3"])
def test_memory_bench_pins_the_cpu_zero_sizes(strategy):
    """The overrides `bench memory` passes are valid and give the CPU sizes even where CUDA defaults apply."""
    params = 153_000_000
    overrides = memory.zero_overrides(strategy, params)
    if strategy == "ddp":
        assert overrides == []
        return
    cfg = load_config(None, [f"parallel.strategy={strategy}", *overrides])
    default = load_config(None, [f"parallel.strategy={strategy}"])
    pinned = deepspeed_config(cfg.parallel, 2, 1, 2, params, device=torch.device("cuda"))["zero_optimization"]
    cpu = deepspeed_config(default.parallel, 2, 1, 2, params, device=torch.device("cpu"))["zero_optimization"]
    for zero in (pinned, cpu):  # sub-groups have no key: on CUDA they stay DeepSpeed's
        zero.pop("sub_group_size", None)
    assert pinned == cpu and cpu["reduce_bucket_size"] == math.floor(params / 10)


COPY_FAULTS = """
import resource, statistics, torch
crops = torch.zeros(64, 224, 224, 3, dtype=torch.uint8)  # a loader's reused buffer
faults = []
for _ in range(24):
    f0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    batch = crops.clone()  # what leaves the loader each batch
    faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - f0)
    del batch
print(statistics.median(faults[-8:]))  # glibc settles after a few: its threshold rises as blocks are freed
"""


def test_timed_workers_copy_batches_as_training_does():
    """Workers whose times are read run with training's malloc, not the memory benchmarks' (RSS_ENV): there a batch
    copied out of a loader would page-fault all its 9.6 MB afresh (and unmap it across cores) every batch."""
    import subprocess
    import sys

    def faults_per_copy(memory: bool) -> float:
        out = subprocess.run([sys.executable, "-c", COPY_FAULTS], env=worker.worker_env(memory), capture_output=True,
                             text=True, check=True)
        return float(out.stdout.split()[-1])

    assert faults_per_copy(memory=False) < 100
    assert worker.worker_env(memory=True).items() >= worker.RSS_ENV.items()  # where the copy faults, page by page


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


def test_universal_bench_converts_a_zero_checkpoint_and_refuses_other_strategies(tmp_path):
    """`bench universal` at test size: a one-step ZeRO-2 run on 1 rank (in this process), its checkpoint converted,
    sized and timed; the other ranks' wait is the process group's timeout plus the checkpoint at 5 MB/s plus its files
    at 20 ms each."""
    from convit_scale.bench.universal import bench_universal

    with pytest.raises(ValueError, match="--strategies fsdp2: allowed: zero1, zero2, zero3"):
        bench_universal(tmp_path, "convit_nano", 28, [1], ["zero2", "fsdp2"])
    (row,) = bench_universal(tmp_path, "convit_nano", 28, [1], ["zero2"])["rows"]
    assert row["zero_bytes"] > 0 and row["universal_bytes"] > 0 and row["seconds"] > 0, row
    assert 0 < row["universal_files"] <= row["files_bound"], row
    assert row["others_wait_up_to_s"] == pytest.approx(600 + row["zero_bytes"] / 5e6 + row["files_bound"] * 0.02)
    assert not (tmp_path / "zero2_1" / "checkpoints").exists()


NO_FFCV = """
import importlib, sys
class NoFfcv:
    def find_spec(self, name, path=None, target=None):
        if name == "ffcv" or name.startswith("ffcv."):
            raise ImportError(f"No module named {name!r} (blocked: a machine without FFCV)")
sys.meta_path.insert(0, NoFfcv())
import convit_scale.bench
from convit_scale.bench.__main__ import WORKERS
for kind in ("model", "train", "inference", "distill", "gate"):
    importlib.import_module("convit_scale.bench." + WORKERS[kind])
for name in ("memory", "universal"):
    importlib.import_module("convit_scale.bench." + name)
try:
    importlib.import_module("convit_scale.bench.data")
except ImportError as e:
    print("data:", e)
"""


def test_bench_imports_without_ffcv():
    """A GPU machine without FFCV (it builds from source) still runs every benchmark but ``bench data``: the
    benchmarks' dispatchers import only the benchmark that runs. The blocker is real: ``bench.data`` then fails."""
    import subprocess
    import sys

    from support import REPO

    res = subprocess.run([sys.executable, "-c", NO_FFCV], capture_output=True, text=True, cwd=REPO, timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    assert "data: No module named 'ffcv" in res.stdout, res.stdout


def test_gate_bench_times_each_candidate_on_a_real_zero_step():
    """`bench gate`'s measurement at test size, in this process (a one-rank group): the hooks it replaced, the fused
    norm, DeepSpeed's own check (ZeRO-1/2), beside a whole step of the real strategy."""
    from convit_scale.bench.gate import bench_gate
    from convit_scale.bench.gate import worker as gate_worker
    from convit_scale.models import create_model

    with pytest.raises(ValueError, match="--strategies ddp: allowed: zero1, zero2, zero3"):
        bench_gate("convit_nano", 16, 2, 1, ["ddp"], "cpu", "fp32")
    row = gate_worker({"model": "convit_nano", "img_size": 16, "batch": 2, "steps": 1, "strategy": "zero2",
                  "precision": "bf16", "device": "cpu", "repeat": 2})
    assert row["tensors"] == sum(1 for _ in create_model("convit_nano").parameters())
    assert all(row[k] > 0 for k in ("step_ms", "hooks_ms_per_micro_batch", "fused_ms_per_step",
                                    "deepspeed_check_ms_per_step"))


def test_crop_decode_bench_times_the_whole_decode_beside_the_box(tmp_path):
    """`bench data --decode-only`'s measurement at test size: both candidates on the same JPEGs, every box decoded
    by the crop-region decoder (none refused)."""
    from test_jpeg import encode, photo_like

    from convit_scale.bench.crop_decode import crop_decode_costs

    (tmp_path / "train" / "c0").mkdir(parents=True)
    for k in range(3):
        (tmp_path / "train" / "c0" / f"{k}.JPEG").write_bytes(encode(photo_like(75, 100, seed=k), quality=90))
    res = crop_decode_costs(str(tmp_path), 0.02)
    assert res["images"] == 3 and res["box_refused"] == 0 and res["box_decodes"] >= 3 * 2
    for kind in ("decode", "with_resize", "webdataset"):
        assert res[kind]["whole_cpu_ms_per_image"] > 0 and res[kind]["box_cpu_ms_per_image"] > 0
        assert res[kind]["whole_vs_box"] > 0
