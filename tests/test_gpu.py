"""GPU acceptance (`make gpu-test GROUP=N`): what only a GPU run shows, on the real engine under NCCL.

Collected everywhere, skipped without CUDA. On a GPU machine the tests run in groups, each one pytest command of at
most 8 minutes on one H200 (docs/gpu.md counts their launches and steps), the first the most telling:
- g1: every kind of collective a one-GPU run sends reaching NCCL; a bf16 step under ddp, fsdp2, zero2 and zero3, each
  stopped by SIGUSR1 (exit 75, checkpoint) and resumed; the universal resume of zero2/zero3 (a checkpoint declared as
  written on 2 ranks) with the optimizer state on the GPU; ZeRO-3 on the rank's GPU when LOCAL_RANK names another;
  DDP and FSDP2 steps under CUDA's sync debug mode; the heartbeat's GPU progress, asked without waiting. All in this
  process: no interpreter start but pytest's.
- g2: the command end to end for each strategy (`convit-scale train` stopped by the signal, resumed, through the
  universal checkpoint for ZeRO, `export`, `eval` on the GPU, `analyze` for fsdp2).
- g3: bf16 and fp16 against fp32, fp16 loss scaling, an injected infinite gradient skipped exactly, NCCL's flight
  recorder off by default, its collectives when on and its cost per step (two launches), the CUDA device augmentation
  equal to the CPU's, the device resize equal to PIL's and nvJPEG's decode measured against PIL's.
- g4: a tiny run that learns, `bench gate`, the device augmentation's and device resize's throughput, FFCV batches
  pinned.
- g5: `bench model` and `bench mfu` (ConViT-B+, compiled).
- g6: two ranks against one under NCCL, which needs two GPUs (NCCL refuses two ranks on one GPU): FSDP2's sharded
  NCCL path (all-gather, reduce-scatter) is exercised only there, since FSDP2 skips both at world size 1.
The numbers (JSON) go under GPU_TEST_OUT (default runs/gpu-test), for BENCHMARKS.md. The data is a small synthetic
ImageFolder tree made here: a GPU box need not have the Debian dataset package.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch
from support import built_strategy, one_rank_group, strategy_step, universal_state_placement

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(),
                                 reason="needs a CUDA device (run `make gpu-test` on a GPU machine)")]

REPO = Path(__file__).resolve().parents[1]
PY = sys.executable
OUT = Path(os.environ.get("GPU_TEST_OUT", REPO / "runs" / "gpu-test"))
NPROC = min(2, torch.cuda.device_count()) if torch.cuda.is_available() else 1
"""Ranks of the runs through the command: every visible GPU up to two."""
STRATEGIES = ["ddp", "fsdp2", "zero2", "zero3"]
WARMUP_STEPS = 2
"""Steps before a sync-debug check: DDP rebuilds its buckets once, in the second forward, with a blocking
device-to-host copy, and the first step makes the caches later steps reuse."""


def _cli(*args, env=None, timeout=600, **kw):
    return subprocess.run([PY, "-m", "convit_scale.cli", *map(str, args)], cwd=REPO, capture_output=True, text=True,
                          timeout=timeout, env={**os.environ, "PYTHONPATH": str(REPO), **(env or {})}, **kw)


def _records(run: Path, kind: str = "train") -> list[dict]:
    from convit_scale.metrics import read_records

    return read_records(run, kind)


def _write(name: str, obj) -> None:
    OUT.mkdir(parents=True, exist_ok=True)
    (OUT / name).write_text(json.dumps(obj, indent=1))


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


def _in_process(recipe: Path, *overrides: str) -> int:
    """The recipe on this GPU in this process (a one-rank NCCL group)."""
    from convit_scale.config import load_config
    from convit_scale.train.engine import exit_status

    return exit_status(load_config(recipe, list(overrides)))


def _declare_world_size(checkpoint: Path, world: int) -> None:
    """Rewrite a checkpoint's meta.json as written on ``world`` ranks: a resume on another number then goes through
    DeepSpeed's universal checkpoint, as a requeue onto fewer GPUs would."""
    meta = json.loads((checkpoint / "meta.json").read_text())
    (checkpoint / "meta.json").write_text(json.dumps({**meta, "world_size": world}, indent=1))


LEARN = {"mixup": 0.0, "cutmix": 0.0, "rand_augment": None, "reprob": 0.0, "color_jitter": 0.0}


# -- g1: the first run on a GPU machine ---------------------------------------------------------------------------


@pytest.mark.g1
def test_every_kind_of_collective_a_one_gpu_run_sends_reaches_nccl(tree, tmp_path):
    """World size 1 calls the real collectives through NCCL: the step's packed all-reduce, the evaluation's
    reduction, the analysis's broadcast of the weights. FSDP2 itself sends nothing at world size 1 (since torch 2.9 it
    skips its all-gather and reduce-scatter on a one-rank mesh): its sharded path is g6's check, on two GPUs."""
    from torch.profiler import ProfilerActivity, profile

    r = _recipe(tmp_path, tree, "kinds", schedule={"max_steps": 2, "epochs": 1}, log={"analysis_images": 32})
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        assert _in_process(r) == 0
    names = sorted({e.name for e in prof.events() if "nccl" in e.name.lower()})
    _write("nccl_collectives.json", names)
    kinds = {n.lower().replace("allreduce", "all_reduce") for n in names}
    for kind in ("all_reduce", "broadcast"):
        assert any(kind in n for n in kinds), (kind, names)


def _stop_when(run: Path, steps: int, done: threading.Event) -> threading.Thread:
    """A thread that sends this process SIGUSR1 (Slurm's pre-timeout signal) once ``run`` logged ``steps`` steps,
    unless the run is over."""
    def watch():
        while not done.is_set():
            if len(_records(run)) >= steps:
                os.kill(os.getpid(), signal.SIGUSR1)
                return
            time.sleep(0.1)

    thread = threading.Thread(target=watch, daemon=True)
    thread.start()
    return thread


@pytest.mark.g1
@pytest.mark.parametrize("strategy", STRATEGIES)
def test_a_bf16_run_stops_on_the_signal_and_resumes(strategy, tree, tmp_path):
    """bf16 on the GPU under NCCL: stopped by SIGUSR1 after its third step (exit 75, a checkpoint), then resumed for
    three more steps from it: every step logged once, every loss finite; the heartbeat says the GPU finished them."""
    previous = signal.signal(signal.SIGUSR1, lambda *a: None)  # the run's handler restores this one: a late signal
    # after the run (the watcher's) is then harmless
    r = _recipe(tmp_path, tree, strategy, parallel={"strategy": strategy}, schedule={"max_steps": 400},
                data={"val_path": ""})
    done = threading.Event()
    try:
        _stop_when(tmp_path / strategy, 3, done)
        assert _in_process(r) == 75
    finally:
        done.set()
        signal.signal(signal.SIGUSR1, previous)
    (stopped,) = _records(tmp_path / strategy, "stopped")
    assert _in_process(r, f"schedule.max_steps={stopped['step'] + 3}") == 0
    train = _records(tmp_path / strategy)
    assert [t["step"] for t in train] == list(range(1, stopped["step"] + 4))
    assert all(t["loss"] is not None and t["loss"] == t["loss"] for t in train)
    # what the GPU finished (a CUDA event per mark, asked with query()): the last step's update, once saved
    device = json.loads((tmp_path / strategy / "heartbeat" / "rank_0.json").read_text())["device"]
    assert (device["step"], device["what"]) == (stopped["step"] + 3, "update"), device


@pytest.mark.g1
@pytest.mark.parametrize("strategy", ["zero2", "zero3"])
def test_a_universal_resume_puts_the_optimizer_state_on_the_gpu(strategy, tmp_path):
    """A ZeRO checkpoint declared as written on 2 ranks, loaded on this one GPU through DeepSpeed's universal
    checkpoint (the GPU defaults: persistence threshold 1e5, overlapped reduction, the fused AdamW): every optimizer
    state tensor on the parameter's device, ``step`` float32, and the next step runs. DeepSpeed hands ``step`` back on
    the host, which the fused AdamW reads through a device pointer (an illegal memory access without HMM)."""
    cuda = torch.device("cuda", 0)
    with one_rank_group(cuda):
        placed = universal_state_placement(cuda, tmp_path, f"parallel.strategy={strategy}", "parallel.precision=bf16")
    _write(f"universal_state_{strategy}.json", [[str(v) for v in row] for row in placed])
    assert placed and all(fused for *_, fused in placed)
    for key, dtype, device, param_dtype, param_device, _ in placed:
        assert device == param_device and device.type == "cuda", (key, device, param_device)
        assert dtype == (torch.float32 if key == "step" else param_dtype), (key, dtype)


@pytest.mark.g1
def test_zero3_runs_on_the_ranks_gpu_when_local_rank_names_another():
    """A site that gives each task one GPU starts local rank 3 with LOCAL_RANK=3 and one visible device: the rank's
    GPU is cuda:0 (LOCAL_RANK modulo the visible devices), and ZeRO-3's ``zero.Init`` and trace checks, which read
    LOCAL_RANK themselves, must not ask for cuda:3 ("invalid device ordinal")."""
    with one_rank_group(torch.device("cuda"), local_rank=3) as ctx:
        assert ctx.device == torch.device("cuda", 3 % torch.cuda.device_count())
        strategy = built_strategy(ctx.device, "parallel.strategy=zero3", "parallel.precision=bf16")
        try:
            for seed in range(3):
                strategy_step(strategy, ctx.device, seed=seed)
            assert strategy._engine.device == ctx.device
        finally:
            strategy.close()
        assert os.environ["LOCAL_RANK"] == "3"


@pytest.mark.g1
@pytest.mark.parametrize("strategy", ["ddp", "fsdp2"])  # DeepSpeed's own step reads the device (its norm checks)
def test_a_training_step_waits_for_the_gpu_once(strategy, tree, tmp_path, monkeypatch):
    """Under CUDA's sync debug mode every stream synchronisation of a step raises, except the decision read of its
    packed reduction: the device augmentation, the loss, the gradient norm and the update queue without waiting.
    Checked from the third step, whatever ran before in this process (``WARMUP_STEPS``)."""
    from convit_scale.train import loop
    from convit_scale.train.step import StepStats

    read, step, calls = StepStats.read, loop.train_step, []

    def allowed_read(reduced):
        mode = torch.cuda.get_sync_debug_mode()
        torch.cuda.set_sync_debug_mode("default")
        try:
            return read(reduced)
        finally:
            torch.cuda.set_sync_debug_mode(mode)

    def strict_step(*args):
        calls.append(1)
        if len(calls) <= WARMUP_STEPS:
            return step(*args)
        torch.cuda.set_sync_debug_mode("error")
        try:
            return step(*args)
        finally:
            torch.cuda.set_sync_debug_mode("default")

    monkeypatch.setattr(StepStats, "read", staticmethod(allowed_read))
    monkeypatch.setattr(loop, "train_step", strict_step)
    r = _recipe(tmp_path, tree, f"sync_{strategy}", parallel={"strategy": strategy},
                schedule={"max_steps": WARMUP_STEPS + 2}, data={"val_path": "", "augment_on": "device"})
    assert _in_process(r) == 0
    assert len(calls) == WARMUP_STEPS + 2 and len(_records(tmp_path / f"sync_{strategy}")) == WARMUP_STEPS + 2


# -- g2: the command, end to end ------------------------------------------------------------------------------------


@pytest.mark.g1
def test_the_heartbeats_gpu_progress_asks_without_waiting():
    """What the heartbeat says the GPU finished (DeviceProgress): a CUDA event per mark, asked from another thread (the
    watchdog's) with query(): behind a second of GPU work it answers at once with the last mark before it."""
    from convit_scale.train.watchdog import DeviceProgress

    progress = DeviceProgress.on(torch.device("cuda"))
    progress.record(1, 1, "update")
    torch.cuda.synchronize()
    torch.cuda._sleep(2_000_000_000)  # about a second of the GPU's clock cycles
    progress.record(2, 1, "update")
    seen = []
    t0 = time.time()
    asker = threading.Thread(target=lambda: seen.append(progress.poll()))
    asker.start()
    asker.join()
    assert time.time() - t0 < 0.5 and seen == [{"step": 1, "order": 1, "what": "update"}]
    torch.cuda.synchronize()
    assert progress.poll() == {"step": 2, "order": 1, "what": "update"} and not progress.pending


@pytest.mark.g2
@pytest.mark.parametrize("strategy", STRATEGIES)
def test_train_stop_resume_eval_export_bf16(strategy, tree, tmp_path):
    """`convit-scale train` on every visible GPU (up to two) stopped by SIGUSR1 to its process group (exit 75), resumed
    by the command (ZeRO: from its checkpoint declared as written on 2 ranks more, through the universal checkpoint),
    then `export` (each checkpoint format: DCP, ZeRO-2, ZeRO-3), `eval` on the GPU (fsdp2, zero3) and `analyze`
    (fsdp2)."""
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
    assert "on cuda (nccl" in out and f"{NPROC} rank(s)" in out
    (stopped,) = _records(run, "stopped")
    step = stopped["step"]
    if strategy.startswith("zero"):
        _declare_world_size(Path(stopped["checkpoint"]), NPROC + 1)
    res = _cli("train", "--recipe", r, "--nproc-per-node", NPROC, f"schedule.max_steps={step + 6}")
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-4000:]
    assert f"resumed step {step} from {NPROC + 1 if strategy.startswith('zero') else NPROC} rank(s)" in res.stdout
    train = _records(run)
    assert [t["step"] for t in train] == list(range(1, step + 7))
    assert all(t["loss"] is not None and t["loss"] == t["loss"] for t in train)
    (end,) = _records(run, "end")
    assert end["samples"] == 120 and 0 <= end["top1"] <= 100
    exported = tmp_path / f"{strategy}.safetensors"
    res = _cli("export", "--checkpoint", end["checkpoint"], "--out", exported)
    assert res.returncode == 0, res.stderr[-3000:]
    if strategy not in ("fsdp2", "zero3"):  # an exported file is one format: evaluated for one DCP and one ZeRO run
        return
    res = _cli("eval", "--checkpoint", exported, "--data", tree, "--format", "imagefolder", "--workers", 0)
    assert res.returncode == 0 and "images on cuda" in res.stdout, res.stdout + res.stderr[-3000:]
    if strategy == "fsdp2":  # analyze runs on the GPU by default (CKA sums, masking, distances on the device)
        res = _cli("analyze", "--checkpoint", exported, "--data", tree, "--format", "imagefolder",
                   "--out", tmp_path / "analysis", "--images", 100)
        assert res.returncode == 0, res.stderr[-3000:]
        result = json.loads((tmp_path / "analysis" / "analysis.json").read_text())
        assert result["images"] == 100 and result["device"].startswith("cuda")


# -- g3: precision and the bad step -----------------------------------------------------------------------------------


def _losses(tmp: Path, tree: Path, name: str, precision: str, strategy: str = "ddp", steps: int = 20) -> list:
    r = _recipe(tmp, tree, name, data={**LEARN, "val_path": ""}, schedule={"max_steps": steps},
                parallel={"strategy": strategy, "precision": precision})
    assert _in_process(r) == 0
    return [t["loss"] for t in _records(tmp / name)]


@pytest.fixture(scope="module")
def fp32_losses(tree, tmp_path_factory) -> list:
    """The fp32 run the low-precision runs are compared with (once for the module)."""
    return _losses(tmp_path_factory.mktemp("fp32"), tree, "fp32", "fp32")


@pytest.mark.g3
@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_low_precision_losses_track_fp32(precision, fp32_losses, tree, tmp_path):
    low = _losses(tmp_path, tree, precision, precision)
    assert len(fp32_losses) == len(low) == 20 and all(x is not None for x in fp32_losses + low)
    assert all(abs(a - b) <= 0.05 * abs(a) + 0.02 for a, b in zip(fp32_losses, low)), (fp32_losses, low)


@pytest.mark.g3
@pytest.mark.parametrize("strategy", ["ddp", "zero2"])
def test_fp16_with_loss_scaling(strategy, tree, tmp_path):
    losses = [x for x in _losses(tmp_path, tree, strategy, "fp16", strategy, steps=12) if x is not None]
    assert len(losses) >= 8 and all(x == x and abs(x) < 1e4 for x in losses)


@pytest.mark.g3
@pytest.mark.parametrize("strategy", STRATEGIES)
def test_injected_inf_gradient_is_skipped_exactly_under_nccl(strategy, tree, tmp_path, monkeypatch):
    monkeypatch.setenv("CONVIT_SCALE_INF_GRAD_AT_STEP", "2")  # read once, at set-up
    r = _recipe(tmp_path, tree, "inf", parallel={"strategy": strategy}, schedule={"max_steps": 5},
                data={"val_path": "", "micro_batch_size": 32}, log={"debug_digest": True})
    assert _in_process(r) == 0
    digests = {d["step"]: d["state_digest"] for d in _records(tmp_path / "inf", "digest")}
    assert digests[3] == digests[2] and digests[4] != digests[3]
    assert _records(tmp_path / "inf")[-1]["skipped_steps"] == 1


@pytest.mark.g3
def test_the_flight_recorder_is_off_by_default_and_its_cost_per_step_is_measured(tmp_path):
    """NCCL's flight recorder (fault.nccl_trace_entries; recent torch's default is on) on and off, each in its own
    process (torch reads its size once per process): on, a hang report's trace holds the collectives the rank entered;
    off (the default), nothing is recorded. The same DDP steps and the same small all-reduces are timed both ways
    (tests/nccl_trace_cost.py): the ratios go to nccl_flight_recorder.json, for BENCHMARKS.md."""
    from convit_scale.config import FaultConfig

    assert FaultConfig().nccl_trace_entries == 0
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), str(REPO / "tests"),
                                                        os.environ.get("PYTHONPATH", "")])}
    runs = {}
    for entries in (0, 2000):
        out = tmp_path / f"{entries}.json"
        r = subprocess.run([PY, str(REPO / "tests" / "nccl_trace_cost.py"), str(entries), str(out)], cwd=REPO, env=env,
                           capture_output=True, text=True, timeout=300)
        assert r.returncode == 0, r.stderr[-3000:]
        runs[entries] = json.loads(out.read_text())
    off, on = runs[0], runs[2000]
    assert off["recorded"] == 0, off
    assert any("all_reduce" in n.replace("allreduce", "all_reduce") for n in on["names"]), on
    _write("nccl_flight_recorder.json", {"off": off, "on": on,
                                         "step_ratio_on_off": round(on["step_ms"] / off["step_ms"], 4),
                                         "per_collective_us_added": round(on["per_collective_us"]
                                                                          - off["per_collective_us"], 2)})


@pytest.mark.g3
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


@pytest.mark.g3
def test_device_resize_and_nvjpeg_decode_on_cuda():
    """The batched resize on CUDA is PIL's exactly (TF32 or not: its sums are exact integers); nvJPEG's decode is
    recorded against PIL's (another IDCT may differ), and the crops from it are PIL's resize of nvJPEG's own whole
    image, exactly."""
    import io

    import numpy as np
    from PIL import Image
    from test_jpeg import photo_like
    from torchvision.io import ImageReadMode, decode_jpeg

    from convit_scale.data.device_resize import decode_crop_resize, resize_packed

    rng = np.random.default_rng(0)
    shapes = [(1, 1), (7, 300), (500, 375), (375, 500), (60, 61), (250, 2), (1200, 900)]
    imgs = [rng.integers(0, 256, (h, w, 3), dtype=np.uint8) for h, w in shapes]
    flat = torch.from_numpy(np.concatenate([a.reshape(-1) for a in imgs])).cuda()
    out = resize_packed(flat, torch.tensor(shapes), 224).cpu()
    for a, o in zip(imgs, out):
        assert np.array_equal(o.permute(1, 2, 0).numpy(), np.asarray(Image.fromarray(a).resize((224, 224), 3)))
    buf = io.BytesIO()
    Image.fromarray(photo_like(427, 640, seed=1)).save(buf, "JPEG", quality=90)
    data = torch.frombuffer(bytearray(buf.getvalue()), dtype=torch.uint8)
    boxes = torch.tensor([(0, 0, 427, 640), (10, 20, 300, 280), (100, 200, 60, 80)])
    res = decode_crop_resize([data] * 3, boxes, 224, None, "cuda")
    assert res.refused == 0 and not res.failed
    nv = decode_jpeg(data, mode=ImageReadMode.RGB, device="cuda").permute(1, 2, 0).cpu().numpy()
    pil = np.asarray(Image.open(io.BytesIO(buf.getvalue())).convert("RGB"))
    for (t, left, h, w), got in zip(boxes.tolist(), res.images.cpu()):
        want = np.asarray(Image.fromarray(nv[t:t + h, left:left + w]).resize((224, 224), 3))
        assert np.array_equal(got.permute(1, 2, 0).numpy(), want)
    d = np.abs(nv.astype(int) - pil)
    _write("nvjpeg_vs_pil.json", {"max_abs_diff": int(d.max()), "mean_abs_diff": float(d.mean()),
                                  "share_differing": float((d > 0).mean()), "device": torch.cuda.get_device_name()})


@pytest.mark.g3
def test_nvjpeg_batches_with_files_it_cannot_or_must_not_decode():
    """One batch as ImageNet has them: baseline, progressive and greyscale JPEGs on the device; a CMYK JPEG and a PNG
    under a .JPEG name on the host (PIL, counted); a truncated JPEG listed as failed (replaced by the loader), never
    its garbage decoded. The batch's good images are those it gives alone."""
    import io

    from PIL import Image
    from test_jpeg import encode, photo_like

    from convit_scale.data.device_resize import decode_crop_resize

    rgb = photo_like(90, 120, seed=3)
    png = io.BytesIO()
    Image.fromarray(rgb).save(png, "PNG")
    good = [encode(rgb, quality=90), encode(rgb, quality=80, progressive=True), encode(rgb, mode="L", quality=90)]
    files = good + [encode(rgb, mode="CMYK", quality=90), png.getvalue(), good[0][:len(good[0]) // 2]]
    data = [torch.frombuffer(bytearray(f), dtype=torch.uint8) for f in files]
    box = torch.tensor([(5, 7, 60, 80)])
    res = decode_crop_resize(data, box.repeat(len(data), 1), 224, None, "cuda")
    assert res.refused == 2 and list(res.failed) == [5], (res.refused, res.failed)
    for k in range(3):
        alone = decode_crop_resize(data[k:k + 1], box, 224, None, "cuda").images[0]
        assert torch.equal(res.images[k], alone), k
    # the training path: decoded on its own stream, resized on the training stream, the same pixels and counts
    from convit_scale.data.device_images import _decode_on_its_stream

    flips = torch.zeros(len(data), dtype=torch.bool)
    streamed = _decode_on_its_stream(data, box.repeat(len(data), 1), 224, flips, torch.device("cuda"), {})
    assert torch.equal(streamed.images, res.images) and (streamed.refused, streamed.failed) == (2, res.failed)


# -- g4: learning, the gate, the device stage, FFCV -------------------------------------------------------------------


@pytest.mark.g4
def test_the_tiny_run_learns(tree, tmp_path):
    """Ten colour classes with noise: far above chance (10%) after a few hundred steps, or the GPU path is broken."""
    r = _recipe(tmp_path, tree, "learn", data=LEARN, optim={"base_lr": 2e-3},
                schedule={"epochs": 40, "warmup_epochs": 2})
    res = _cli("train", "--recipe", r, "--nproc-per-node", NPROC, timeout=900)
    assert res.returncode == 0, res.stderr[-4000:]
    (end,) = _records(tmp_path / "learn", "end")
    _write("learn.json", end)
    assert end["top1"] > 60, end


def _bench(*args, timeout=900):
    kind = args[0]
    res = _cli("bench", *args, "--device", "cuda", "--out", OUT / kind, timeout=timeout)
    assert res.returncode == 0, res.stderr[-4000:]
    assert list((OUT / kind).glob("*.json")), f"bench {kind} wrote no JSON"


@pytest.mark.g4
def test_the_zero_gate_bench_writes_its_json():
    """The ZeRO bad-step gate on ConViT-B+ at 224 in bf16: the per-parameter hooks it replaced, the fused norm and
    DeepSpeed's own check, beside a whole step (BENCHMARKS.md, ZeRO section)."""
    _bench("gate", "--precision", "bf16", "--model", "convit_base_plus", "--img-size", "224", "--batch", "32",
           "--steps", "5")


@pytest.mark.g4
def test_device_augmentation_throughput():
    from convit_scale.data.device_augment import augment_batch

    cuda = torch.device("cuda")
    x = torch.randint(0, 256, (256, 3, 224, 224), dtype=torch.uint8).to(cuda)
    for step in range(2):
        augment_batch(x, torch.arange(256, dtype=torch.int64) + step * 256)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for step in range(20):
        augment_batch(x, torch.arange(256, dtype=torch.int64) + (2 + step) * 256)
    torch.cuda.synchronize()
    ips = 256 * 20 / (time.perf_counter() - t0)
    _write("device_augment.json", {"images_per_s": ips, "device": torch.cuda.get_device_name()})
    assert ips > 0


@pytest.mark.g4
def test_device_resize_and_decode_throughput():
    """256 RandomResizedCrop boxes of ImageNet-sized JPEGs (500 x 375): resized on the GPU from the boxes' pixels,
    and decoded + cropped + resized there (nvJPEG), images/s of each."""
    import io

    import numpy as np
    from PIL import Image
    from test_jpeg import photo_like

    from convit_scale.bench.pixels import _boxes
    from convit_scale.data.device_resize import decode_crop_resize, resize_packed

    rng = np.random.default_rng(0)
    photos = [photo_like(375, 500, seed=k) if k % 2 else photo_like(500, 375, seed=k) for k in range(8)]
    boxes = [(k % 8, *_boxes(*photos[k % 8].shape[:2], 1, rng)[0]) for k in range(256)]
    flat = torch.from_numpy(np.concatenate([photos[p][i:i + h, j:j + w].reshape(-1) for p, i, j, h, w in boxes]))
    flat, sizes = flat.cuda(), torch.tensor([(h, w) for _, _, _, h, w in boxes])
    encoded = []
    for p in photos:
        buf = io.BytesIO()
        Image.fromarray(p).save(buf, "JPEG", quality=90)
        encoded.append(torch.frombuffer(bytearray(buf.getvalue()), dtype=torch.uint8))
    jpegs, crop = [encoded[p] for p, *_ in boxes], torch.tensor([b[1:] for b in boxes])
    flips = torch.arange(256) % 2 == 0
    result = {"device": torch.cuda.get_device_name()}
    for name, call in (("resize", lambda: resize_packed(flat, sizes, 224, flips)),
                       ("decode_crop_resize", lambda: decode_crop_resize(jpegs, crop, 224, flips, "cuda"))):
        call()
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(10):
            call()
        torch.cuda.synchronize()
        result[f"{name}_images_per_s"] = 256 * 10 / (time.perf_counter() - t0)
    result["resize_peak_gib"] = torch.cuda.max_memory_allocated() / 2**30
    _write("device_resize.json", result)
    assert all(v > 0 for k, v in result.items() if k.endswith("_per_s"))


@pytest.mark.g4
def test_the_next_micro_batch_made_during_the_step_keeps_the_gpu_busy(tree, tmp_path, monkeypatch):
    """decode_on device (nvJPEG), ConViT-Ti at 224: the step time with the next step's first micro-batch made while
    the GPU finishes the step (the default) and with each made in its turn, after the step's host read
    (``prefetch.json``); the same losses either way."""
    import statistics

    from convit_scale.train.step import StepMicroBatches
    from data_prep import PrepOptions, prepare

    prepare(tree, tmp_path / "wds", PrepOptions(fmt="wds", workers=2, shard_size=128))
    result = {"device": torch.cuda.get_device_name()}
    losses = {}
    for name in ("ahead", "in_turn"):
        if name == "in_turn":
            monkeypatch.setattr(StepMicroBatches, "following", lambda self: None)
        r = _recipe(tmp_path, tree, f"prefetch_{name}", data={**LEARN, "format": "wds",
                                                                 "train_path": str(tmp_path / "wds"), "val_path": "",
                                                                 "decode_on": "device", "global_batch_size": 64},
                    schedule={"max_steps": 40}, checkpoint={"every_steps": 1000})
        assert _in_process(r) == 0
        recs = _records(tmp_path / f"prefetch_{name}")
        losses[name] = [x["loss"] for x in recs]
        result[f"{name}_step_ms"] = 1000 * statistics.median(x["step_time_s"] for x in recs[10:])
    result["ahead_vs_in_turn"] = result["ahead_step_ms"] / result["in_turn_step_ms"]
    _write("prefetch.json", result)
    assert all(abs(a - b) < 1e-3 for a, b in zip(losses["ahead"][:5], losses["in_turn"][:5])), losses


@pytest.mark.g4
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


# -- g5: the model benchmarks ---------------------------------------------------------------------------------------


@pytest.mark.g5
def test_the_model_bench_writes_its_json():
    _bench("model", "--precision", "bf16", "--batch", "64", "--steps", "10", "--rounds", "2")


@pytest.mark.g5
def test_the_mfu_bench_writes_its_json():
    _bench("mfu", "--precision", "bf16", "--models", "convit_base_plus", "--batch", "128", "--compile")


# -- g6: two GPUs ---------------------------------------------------------------------------------------------------


@pytest.mark.g6
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="two ranks need two GPUs (NCCL refuses two ranks on one GPU);"
                    " this is FSDP2's NCCL check (its all-gather and reduce-scatter, skipped at world size 1), and "
                    "it did not run on this box")
@pytest.mark.parametrize("strategy", ["ddp", "fsdp2", "zero3"])
def test_two_ranks_match_one_under_nccl(strategy, tree, tmp_path):
    """The same fp32 run on 2 GPUs and on 1: losses within 1e-3. For fsdp2 the only test that sends FSDP2's
    all-gather and reduce-scatter through NCCL."""
    def losses(name, nproc):
        r = _recipe(tmp_path, tree, name, data={**LEARN, "val_path": ""}, schedule={"max_steps": 6},
                    parallel={"strategy": strategy, "precision": "fp32"}, model={"drop_path_rate": 0.0})
        res = _cli("train", "--recipe", r, "--nproc-per-node", nproc)
        assert res.returncode == 0, res.stderr[-4000:]
        return [t["loss"] for t in _records(tmp_path / name)]

    one, two = losses("one", 1), losses("two", 2)
    _write(f"two_ranks_{strategy}.json", {"one": one, "two": two})
    assert all(abs(a - b) <= 1e-3 * abs(a) for a, b in zip(one, two)), (one, two)
