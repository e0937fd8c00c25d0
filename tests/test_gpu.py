"""GPU acceptance (`make gpu-test`): what only a GPU run shows, on the real engine under NCCL.

Collected everywhere, skipped without CUDA. On a GPU machine it runs, for ddp, fsdp2, zero2 and zero3 in bf16 on
convit_tiny at 224: training on every visible GPU (up to 2 ranks), a stop signal (exit 75, checkpoint), resume,
evaluation and export; the fp16 paths; an injected infinite gradient (the step is skipped exactly); and the
benchmarks whose numbers go into BENCHMARKS.md (`bench model`, `bench mfu`, the device augmentation stage), their
JSON written under GPU_TEST_OUT (default runs/gpu-test). The data is a small synthetic ImageFolder tree made here:
a GPU box need not have the Debian dataset package.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(),
                                 reason="needs a CUDA device (run `make gpu-test` on a GPU machine)")]

REPO = Path(__file__).resolve().parents[1]
PY = sys.executable
OUT = Path(os.environ.get("GPU_TEST_OUT", REPO / "runs" / "gpu-test"))
NPROC = min(2, torch.cuda.device_count()) if torch.cuda.is_available() else 1
"""Ranks of the end-to-end runs: every visible GPU up to two (on one GPU, world size 1 still runs every collective
through NCCL)."""


def _cli(*args, env=None, timeout=600, **kw):
    return subprocess.run([PY, "-m", "convit_scale.cli", *map(str, args)], cwd=REPO, capture_output=True, text=True,
                          timeout=timeout, env={**os.environ, "PYTHONPATH": str(REPO), **(env or {})}, **kw)


def _records(run: Path, kind: str = "train") -> list[dict]:
    from convit_scale.metrics import read_records

    return read_records(run, kind)


@pytest.fixture(scope="module")
def tree(tmp_path_factory) -> Path:
    """10 classes of 96x96 JPEGs, each class a colour with noise: learnable, and made without any download."""
    import numpy as np
    from PIL import Image

    root = tmp_path_factory.mktemp("gpu") / "tree"
    rng = np.random.default_rng(0)
    for split, n in (("train", 48), ("val", 12)):
        for c in range(10):
            folder = root / split / f"n{c:08d}"
            folder.mkdir(parents=True)
            colour = np.array([(c * 37) % 256, (c * 91) % 256, (c * 53) % 256], dtype=np.float32)
            for i in range(n):
                img = np.clip(colour + rng.normal(0, 40, (96, 96, 3)), 0, 255).astype(np.uint8)
                Image.fromarray(img).save(folder / f"{i:05d}.JPEG", quality=90)
    return root


def _recipe(tmp: Path, tree: Path, name: str, **sections) -> Path:
    import yaml

    recipe = {
        "model": {"name": "convit_tiny", "num_classes": 10, "img_size": 224},
        "data": {"format": "imagefolder", "train_path": str(tree), "val_path": str(tree), "global_batch_size": 64,
                 "eval_batch_size": 64, "num_workers": 2, "repeated_aug": 1},
        "schedule": {"epochs": 100, "warmup_epochs": 1},
        "parallel": {"strategy": "fsdp2", "precision": "bf16", "timeout_s": 120},
        "log": {"every_steps": 1, "progress": False},
        "run": {"output_dir": str(tmp / name)},
    }
    for section, values in sections.items():
        recipe.setdefault(section, {}).update(values)
    path = tmp / f"{name}.yaml"
    path.write_text(yaml.safe_dump(recipe))
    return path


@pytest.mark.parametrize("strategy", ["ddp", "fsdp2", "zero2", "zero3"])
def test_train_stop_resume_eval_export_bf16(strategy, tree, tmp_path):
    r = _recipe(tmp_path, tree, strategy, parallel={"strategy": strategy}, schedule={"max_steps": 400})
    run = tmp_path / strategy
    proc = subprocess.Popen([PY, "-m", "convit_scale.cli", "train", "--recipe", str(r), "--nproc-per-node", str(NPROC)],
                            cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True, env={**os.environ, "PYTHONPATH": str(REPO)})
    t0 = time.time()
    while len(_records(run)) < 5:
        assert proc.poll() is None, proc.stdout.read()[-4000:]
        assert time.time() - t0 < 300
        time.sleep(0.2)
    os.killpg(proc.pid, signal.SIGUSR1)  # Slurm's pre-timeout signal
    out = proc.communicate(timeout=300)[0]
    assert proc.returncode == 75, out[-4000:]
    assert "on cuda (nccl" in out and f"world {NPROC}" in out
    step = _records(run, "stopped")[0]["step"]
    res = _cli("train", "--recipe", r, "--nproc-per-node", NPROC, f"schedule.max_steps={step + 6}")
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-4000:]
    train = _records(run)
    assert [t["step"] for t in train] == list(range(1, step + 7))
    assert all(t["loss"] is not None and t["loss"] == t["loss"] for t in train)
    (end,) = _records(run, "end")
    assert end["samples"] == 120 and 0 <= end["top1"] <= 100
    exported = tmp_path / f"{strategy}.safetensors"
    res = _cli("export", "--checkpoint", end["checkpoint"], "--out", exported)
    assert res.returncode == 0, res.stderr[-3000:]
    res = _cli("eval", "--checkpoint", exported, "--data", tree, "--format", "imagefolder", "--workers", 0)
    assert res.returncode == 0 and "images on cuda" in res.stdout, res.stdout + res.stderr[-3000:]
    if strategy == "fsdp2":  # analyze runs on the GPU by default (CKA sums, masking, distances on the device)
        res = _cli("analyze", "--checkpoint", exported, "--data", tree, "--format", "imagefolder",
                   "--out", tmp_path / "analysis", "--images", 100)
        assert res.returncode == 0, res.stderr[-3000:]
        result = json.loads((tmp_path / "analysis" / "analysis.json").read_text())
        assert result["images"] == 100 and result["device"].startswith("cuda")


LEARN = {"mixup": 0.0, "cutmix": 0.0, "rand_augment": None, "reprob": 0.0, "color_jitter": 0.0}


def test_the_tiny_run_learns(tree, tmp_path):
    """Ten colour classes with noise: far above chance (10%) after a few hundred steps, or the GPU path is broken."""
    r = _recipe(tmp_path, tree, "learn", data=LEARN, optim={"base_lr": 2e-3},
                schedule={"epochs": 40, "warmup_epochs": 2})
    res = _cli("train", "--recipe", r, "--nproc-per-node", NPROC, timeout=900)
    assert res.returncode == 0, res.stderr[-4000:]
    (end,) = _records(tmp_path / "learn", "end")
    assert end["top1"] > 60, end


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_low_precision_losses_track_fp32(precision, tree, tmp_path):
    def losses(name, p):
        r = _recipe(tmp_path, tree, name, data={**LEARN, "val_path": ""}, schedule={"max_steps": 20},
                    parallel={"strategy": "ddp", "precision": p})
        res = _cli("train", "--recipe", r, "--nproc-per-node", NPROC)
        assert res.returncode == 0, res.stderr[-4000:]
        return [t["loss"] for t in _records(tmp_path / name)]

    ref, low = losses("fp32", "fp32"), losses(precision, precision)
    assert len(ref) == len(low) == 20 and all(x is not None for x in ref + low)
    assert all(abs(a - b) <= 0.05 * abs(a) + 0.02 for a, b in zip(ref, low)), (ref, low)


@pytest.mark.parametrize("strategy", ["ddp", "zero2"])
def test_fp16_with_loss_scaling(strategy, tree, tmp_path):
    r = _recipe(tmp_path, tree, strategy, parallel={"strategy": strategy, "precision": "fp16"},
                schedule={"max_steps": 12}, data={"val_path": ""})
    res = _cli("train", "--recipe", r, "--nproc-per-node", NPROC)
    assert res.returncode == 0, res.stderr[-4000:]
    losses = [t["loss"] for t in _records(tmp_path / strategy) if t["loss"] is not None]
    assert len(losses) >= 8 and all(x == x and abs(x) < 1e4 for x in losses)


@pytest.mark.parametrize("strategy", ["ddp", "fsdp2", "zero2", "zero3"])
def test_injected_inf_gradient_is_skipped_exactly_under_nccl(strategy, tree, tmp_path):
    r = _recipe(tmp_path, tree, "inf", parallel={"strategy": strategy}, schedule={"max_steps": 5},
                data={"val_path": "", "micro_batch_size": 16 if NPROC == 2 else 32}, log={"debug_digest": True})
    res = _cli("train", "--recipe", r, "--nproc-per-node", NPROC, env={"CONVIT_SCALE_INF_GRAD_AT_STEP": "2"})
    assert res.returncode == 0, res.stderr[-4000:]
    digests = {d["step"]: d["state_digest"] for d in _records(tmp_path / "inf", "digest")}
    assert digests[3] == digests[2] and digests[4] != digests[3]
    assert _records(tmp_path / "inf")[-1]["skipped_steps"] == 1


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="two ranks need two GPUs (NCCL refuses two ranks on one "
                    "GPU); this box has fewer, so the 2-rank comparison under NCCL did not run")
@pytest.mark.parametrize("strategy", ["ddp", "fsdp2", "zero3"])
def test_two_ranks_match_one_under_nccl(strategy, tree, tmp_path):
    def losses(name, nproc):
        r = _recipe(tmp_path, tree, name, data={**LEARN, "val_path": ""}, schedule={"max_steps": 6},
                    parallel={"strategy": strategy, "precision": "fp32"}, model={"drop_path_rate": 0.0})
        res = _cli("train", "--recipe", r, "--nproc-per-node", nproc)
        assert res.returncode == 0, res.stderr[-4000:]
        return [t["loss"] for t in _records(tmp_path / name)]

    one, two = losses("one", 1), losses("two", 2)
    assert all(abs(a - b) <= 1e-3 * abs(a) for a, b in zip(one, two)), (one, two)


def _in_process(recipe: Path) -> int:
    """The recipe on this GPU in this process (a one-rank NCCL group)."""
    from convit_scale.config import load_config
    from convit_scale.train.engine import exit_status

    return exit_status(load_config(recipe))


def test_every_kind_of_collective_reaches_nccl_on_one_gpu(tree, tmp_path):
    """World size 1 still calls the real collectives: the step's reduction, FSDP2's all-gather and reduce-scatter,
    the evaluation's reduction and the analysis's broadcast all pass through NCCL on a one-GPU box."""
    from torch.profiler import ProfilerActivity, profile

    r = _recipe(tmp_path, tree, "kinds", schedule={"max_steps": 2, "epochs": 1}, log={"analysis_images": 32})
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        assert _in_process(r) == 0
    names = sorted({e.name for e in prof.events() if "nccl" in e.name.lower()})
    OUT.mkdir(parents=True, exist_ok=True)
    (OUT / "nccl_collectives.json").write_text(json.dumps(names))
    for kind in ("all_reduce", "gather", "scatter", "broadcast"):
        assert any(kind in n.lower().replace("allgather", "all_gather") for n in names), (kind, names)


def test_a_training_step_waits_for_the_gpu_once(tree, tmp_path, monkeypatch):
    """Under CUDA's sync debug mode every stream synchronisation of a step raises, except the decision read of its
    packed reduction: the device augmentation, the loss, the gradient norm and the update queue without waiting."""
    from convit_scale.train import loop
    from convit_scale.train.step import StepStats

    reduce, step = StepStats.reduce, loop.train_step

    def allowed_read(self):
        torch.cuda.set_sync_debug_mode("default")
        try:
            return reduce(self)
        finally:
            torch.cuda.set_sync_debug_mode("error")

    def strict_step(*args):
        torch.cuda.set_sync_debug_mode("error")
        try:
            return step(*args)
        finally:
            torch.cuda.set_sync_debug_mode("default")

    monkeypatch.setattr(StepStats, "reduce", allowed_read)
    monkeypatch.setattr(loop, "train_step", strict_step)
    for strategy in ("ddp", "fsdp2"):  # DeepSpeed's own step reads the device (its overflow checks)
        r = _recipe(tmp_path, tree, f"sync_{strategy}", parallel={"strategy": strategy}, schedule={"max_steps": 3},
                    data={"val_path": "", "augment_on": "device"})
        assert _in_process(r) == 0
        assert len(_records(tmp_path / f"sync_{strategy}")) == 3


def test_device_augmentation_on_cuda_equals_the_cpus():
    from convit_scale.data.device_augment import DeviceAugmentConfig, augment_batch

    g = torch.Generator().manual_seed(0)
    x = torch.randint(0, 256, (64, 3, 64, 64), generator=g, dtype=torch.uint8)
    seeds = torch.arange(64, dtype=torch.int64) * 7919
    cfg = DeviceAugmentConfig(reprob=0.5)
    cpu, cuda = augment_batch(x, seeds, cfg), augment_batch(x.cuda(), seeds, cfg).cpu()
    level = 1 / 255 / min(cfg.std)  # one uint8 level after normalisation
    off = (cpu - cuda).abs() > 1.5 * level
    assert off.float().mean() < 1e-3, off.float().mean()  # float rounding may move a value by a level, rarely


def test_benchmarks_write_their_json(tmp_path):
    OUT.mkdir(parents=True, exist_ok=True)
    for args in (["model", "--precision", "bf16", "--batch", "64", "--steps", "10", "--rounds", "2"],
                 ["mfu", "--precision", "bf16", "--models", "convit_base_plus", "--batch", "128", "--compile"]):
        res = _cli("bench", *args, "--device", "cuda", "--out", OUT / args[0], timeout=900)
        assert res.returncode == 0, res.stderr[-4000:]
        assert list((OUT / args[0]).glob("*.json")), f"bench {args[0]} wrote no JSON"


def test_device_augmentation_throughput():
    from convit_scale.bench.data import device_augment_rate

    ips = device_augment_rate(torch.device("cuda"), batch=256, img_size=224, steps=20)
    OUT.mkdir(parents=True, exist_ok=True)
    (OUT / "device_augment.json").write_text(json.dumps({"images_per_s": ips, "device": torch.cuda.get_device_name()}))
    assert ips > 0


def test_ffcv_batches_reach_the_gpu_pinned(tree, tmp_path):
    import importlib.util

    if importlib.util.find_spec("ffcv") is None:
        pytest.skip("FFCV is not installed on this machine (it builds from source with OpenCV and libturbojpeg); "
                    "the FFCV loader is covered by the CPU suite")
    from convit_scale.config import DataConfig
    from convit_scale.data import LoaderSpec, build_loader
    from data_prep import PrepOptions, prepare

    prepare(tree, tmp_path / "ffcv", PrepOptions(fmt="ffcv", workers=2))
    d = DataConfig(format="ffcv", train_path=str(tmp_path / "ffcv"), val_path=str(tmp_path / "ffcv"), num_workers=2,
                   repeated_aug=1)
    batch = next(iter(build_loader(d, LoaderSpec("train", 224, 32, pin_memory=True)).epoch(0)))
    assert batch.images.is_pinned()
    x = batch.images.to("cuda", non_blocking=True)
    assert x.shape[0] == 32 and x.is_cuda
    # device mode: channels-last uint8 crops, pinned, made contiguous and augmented on the GPU
    from convit_scale.data.device_augment import augment_batch

    spec = LoaderSpec("train", 224, 32, pin_memory=True, augment_on_device=True)
    batch = next(iter(build_loader(d, spec).epoch(0)))
    assert batch.images.is_pinned() and batch.images.dtype == torch.uint8
    assert batch.images.is_contiguous(memory_format=torch.channels_last)  # one plain copy: no transposition here
    unpinned = next(iter(build_loader(d, LoaderSpec("train", 224, 32, augment_on_device=True)).epoch(0)))
    assert torch.equal(batch.images, unpinned.images) and torch.equal(batch.seeds, unpinned.seeds)
    out = augment_batch(batch.images.to("cuda", non_blocking=True), batch.seeds)
    assert out.is_cuda and out.is_contiguous() and out.shape == (32, 3, 224, 224)
