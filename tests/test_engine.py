"""Training engine with real torch.distributed (gloo), FSDP2 and DeepSpeed on 2 CPU processes."""

import json
import math
import os
import signal
import subprocess
import time

import pytest
import torch

from conftest import REPO, losses, records, ranks_cmd, run_cli, run_ranks, tiny_recipe
from convit_scale.config import ScheduleConfig
from convit_scale.models import create_model
from convit_scale.train.distributed import solve_batch
from convit_scale.train.optim import param_groups
from convit_scale.train.schedule import lr_at, peak_lr

EXACT = {"drop_path_rate": 0.0}
NO_MIX = {"mixup": 0.0, "cutmix": 0.0}


# -- pure pieces -----------------------------------------------------------------------------------
def test_schedule_against_hand_written_table():
    s = ScheduleConfig(epochs=10, warmup_epochs=2, warmup_lr=1e-6, min_lr=1e-5)
    peak = 1e-3
    # steps_per_epoch 10: warmup over steps 0..19, cosine over 20..99
    table = {0: 1e-6, 10: 1e-6 + (1e-3 - 1e-6) * 0.5, 20: 1e-3, 60: 1e-5 + 0.5 * (1e-3 - 1e-5), 100: 1e-5, 150: 1e-5}
    for step, want in table.items():
        assert math.isclose(lr_at(step, peak, 10, s), want, rel_tol=1e-12), step
    assert lr_at(99, peak, 10, s) > 1e-5
    assert peak_lr(5e-4, 1024) == 1e-3 and peak_lr(4e-4, 512) == 4e-4


def test_weight_decay_groups():
    model = create_model("convit_nano")
    groups = {g["group"]: g for g in param_groups(model, 0.05)}
    names = {id(p): n for n, p in model.named_parameters()}
    no_decay = {names[id(p)] for p in groups["no_decay"]["params"]}
    decay = {names[id(p)] for p in groups["decay"]["params"]}
    for n in ("pos_embed", "cls_token", "blocks.0.attn.gating_param", "blocks.0.norm1.weight", "head.bias",
              "blocks.0.attn.pos_proj.bias"):
        assert n in no_decay, n
    for n in ("blocks.0.attn.qk.weight", "blocks.2.attn.qkv.weight", "head.weight", "patch_embed.proj.weight"):
        assert n in decay, n
    assert groups["no_decay"]["weight_decay"] == 0.0 and groups["decay"]["weight_decay"] == 0.05


def test_global_batch_is_solved_or_refused():
    assert solve_batch(1024, 8, None) == (128, 1)
    assert solve_batch(1024, 8, 32) == (32, 4)
    with pytest.raises(ValueError, match="cannot be split over 3 ranks"):
        solve_batch(1024, 3, None)
    with pytest.raises(ValueError, match="does not divide"):
        solve_batch(1024, 8, 48)


# -- real multi-process runs -------------------------------------------------------------------------
@pytest.fixture(scope="module")
def reference_losses(fm_tree, tmp_path_factory):
    """One process, strategy none, the whole global batch in one micro-batch."""
    d = tmp_path_factory.mktemp("ref")
    r = tiny_recipe(d / "r.yaml", "imagefolder", fm_tree, d / "out", model=EXACT, data=NO_MIX,
                    parallel={"strategy": "none"}, schedule={"max_steps": 4})
    res = run_cli("train", "--recipe", str(r))
    assert res.returncode == 0, res.stderr[-3000:]
    got = losses(d / "out")
    assert len(got) == 4 and all(math.isfinite(x) for x in got)
    return got


@pytest.mark.slow
@pytest.mark.parametrize("strategy,micro,extra", [
    ("ddp", None, {}),  # plain FSDP2 against the reference: test_fsdp2_resumes_from_two_ranks_onto_one
    ("fsdp2", 8, {"activation_checkpointing": True, "reshard_after_forward": False}),  # accumulation 2
    ("fsdp2", None, {"hsdp_replicas": 2}),  # HSDP: replicate across 2 groups of 1 shard
    ("fsdp2", None, {"meta_init": True, "activation_checkpointing": True}),
    ("zero1", None, {}),
    ("zero2", 8, {}),  # DeepSpeed's own gradient accumulation
    ("zero3", None, {"zero_bucket_elements": 8000}),  # ZeRO-3 with several optimizer sub-groups per rank
    ("zero3", None, {"zero_offload": True}),  # optimizer on the host: DeepSpeed's CPU Adam
    ("fsdp2", None, {"compile": True, "activation_checkpointing": True}),
], ids=["ddp", "fsdp2-accum-ckpt", "hsdp", "fsdp2-meta", "zero1", "zero2-accum", "zero3-subgroups",
        "zero3-offload", "fsdp2-compile-ckpt"])
def test_two_ranks_match_single_process(fm_tree, tmp_path, reference_losses, strategy, micro, extra):
    r = tiny_recipe(tmp_path / "r.yaml", "imagefolder", fm_tree, tmp_path / "out", model=EXACT,
                    data={**NO_MIX, "micro_batch_size": micro}, parallel={"strategy": strategy, **extra},
                    schedule={"max_steps": 4})
    res = run_ranks(r)
    assert res.returncode == 0, res.stderr[-3000:]
    accum = 1 if micro is None else 16 // micro
    assert f"micro {micro or 16} x accumulation {accum} x world 2" in res.stdout
    got = losses(tmp_path / "out")
    assert len(got) == 4
    if extra.get("meta_init"):  # initialised shard by shard: another random init, so only sanity here
        assert all(math.isfinite(x) for x in got) and abs(got[0] - reference_losses[0]) < 0.5
        return
    for a, b in zip(got, reference_losses):
        assert abs(a - b) < 1e-5, (strategy, got, reference_losses)


def _assert_resume_is_bit_identical(tmp_path, fmt, data_dir, stop, total, **kw):
    """An uninterrupted run of `total` steps against one stopped at `stop` (its checkpoint) and resumed:
    the same per-step losses, bit for bit (fp32 on CPU)."""
    kw["checkpoint"] = {"every_steps": stop}
    full = tiny_recipe(tmp_path / "a.yaml", fmt, data_dir, tmp_path / "a", schedule={"max_steps": total}, **kw)
    assert run_ranks(full).returncode == 0
    part = tiny_recipe(tmp_path / "b.yaml", fmt, data_dir, tmp_path / "b", schedule={"max_steps": stop}, **kw)
    assert run_ranks(part).returncode == 0
    res = run_ranks(part, f"schedule.max_steps={total}")
    assert res.returncode == 0, res.stderr[-3000:]
    assert "resumed from" in res.stdout and f"step_{stop:09d}" in res.stdout
    assert losses(tmp_path / "b") == losses(tmp_path / "a")
    assert len(losses(tmp_path / "a")) == total


@pytest.mark.slow
def test_resume_is_bit_identical_fsdp2_wds(fm_wds, tmp_path):
    """Stopped at step 3 and resumed: the same per-step losses as an uninterrupted run (workers 2)."""
    _assert_resume_is_bit_identical(tmp_path, "wds", fm_wds, 3, 6,
                                    data={"num_workers": 2, "rand_augment": "rand-m9-mstd0.5-inc1"})


@pytest.mark.slow
def test_resume_is_bit_identical_zero3(fm_tree, tmp_path):
    """DeepSpeed's own checkpoint, several optimizer sub-groups per rank, partitions shared with the
    master weights: stopped at step 2 and resumed gives the losses of an uninterrupted run."""
    _assert_resume_is_bit_identical(tmp_path, "imagefolder", fm_tree, 2, 4,
                                    parallel={"strategy": "zero3", "zero_bucket_elements": 8000})


@pytest.mark.slow
@pytest.mark.parametrize("strategy", ["fsdp2", "zero3"])
def test_sharded_model_state_is_near_the_ideal(fm_tree, tmp_path, strategy):
    """Live tensors per rank before an optimizer step (parameters, gradients, both Adam moments and the
    strategy's persistent buffers) within 1.2x of 16 bytes x parameters / world, at 2 ranks. ZeRO-3 only
    meets it because its fp32 partitions double as the master weights (`share_fp32_master_partitions`)."""
    extra = {"zero_bucket_elements": 100_000} if strategy == "zero3" else {}
    r = tiny_recipe(tmp_path / "r.yaml", "imagefolder", fm_tree, tmp_path / "out",
                    model={"name": "convit_tiny", "img_size": 32}, data={"global_batch_size": 4},
                    parallel={"strategy": strategy, **extra}, schedule={"max_steps": 2},
                    checkpoint={"every_steps": 100}, log={"debug_memory": True})
    res = run_ranks(r)
    assert res.returncode == 0, res.stderr[-3000:]
    params = sum(p.numel() for p in create_model("convit_tiny", num_classes=10, img_size=32).parameters())
    ideal = 16 * params / 2 / 2**20
    state = records(tmp_path / "out")[-1]["state_mem_mb"]
    assert len(state) == 2 and all(0.95 * ideal < s < 1.2 * ideal for s in state), (state, ideal)


@pytest.mark.slow
def test_fsdp2_resumes_from_two_ranks_onto_one(fm_tree, tmp_path, reference_losses):
    r = tiny_recipe(tmp_path / "r.yaml", "imagefolder", fm_tree, tmp_path / "out", model=EXACT, data=NO_MIX,
                    schedule={"max_steps": 2})
    assert run_ranks(r).returncode == 0
    res = run_cli("train", "--recipe", str(r), "schedule.max_steps=4")  # one process now
    assert res.returncode == 0, res.stderr[-3000:]
    assert "1 rank(s)" in res.stdout and "resumed from" in res.stdout
    got = losses(tmp_path / "out")
    assert len(got) == 4
    for a, b in zip(got, reference_losses):  # same data position, resharded state
        assert abs(a - b) < 1e-5


@pytest.mark.slow
def test_nan_policy_skip_and_stop(fm_tree, tmp_path):
    r = tiny_recipe(tmp_path / "skip.yaml", "imagefolder", fm_tree, tmp_path / "skip", schedule={"max_steps": 4})
    res = run_ranks(r, env={"CONVIT_SCALE_NAN_AT_STEP": "1"})
    assert res.returncode == 0, res.stderr[-3000:]
    recs = records(tmp_path / "skip")
    assert recs[1]["loss"] is None and recs[1]["skipped_steps"] == 1 and recs[-1]["skipped_steps"] == 1
    assert all(math.isfinite(x["loss"]) for i, x in enumerate(recs) if i != 1)
    assert records(tmp_path / "skip", "end")[0]["skipped_steps"] == 1

    # stop: the good checkpoint of step 2 stays the newest; nothing is written after the NaN
    r = tiny_recipe(tmp_path / "stop.yaml", "imagefolder", fm_tree, tmp_path / "stop", schedule={"max_steps": 6},
                    run={"nonfinite_policy": "stop"}, checkpoint={"every_steps": 1, "keep_last": 5})
    res = run_ranks(r, env={"CONVIT_SCALE_NAN_AT_STEP": "2"})
    assert res.returncode != 0 and "non-finite loss at step 2" in res.stderr
    ckpts = sorted(p.name for p in (tmp_path / "stop" / "checkpoints").iterdir())
    assert ckpts == ["step_000000001", "step_000000002"]
    meta = json.loads((tmp_path / "stop" / "checkpoints" / "step_000000002" / "meta.json").read_text())
    assert meta["step"] == 2


@pytest.mark.slow
@pytest.mark.parametrize("strategy", ["ddp", "zero2"])
def test_nan_in_a_later_micro_batch_discards_the_whole_step(fm_tree, tmp_path, strategy):
    """Accumulation 2: a NaN in the second micro-batch of step 1 discards the first one's gradients too
    (DDP's and DeepSpeed's): the run goes on exactly as when the NaN is in the first micro-batch."""
    got = {}
    for where in ("1:0", "1:1"):
        out = tmp_path / where.replace(":", "_")
        r = tiny_recipe(tmp_path / "r.yaml", "imagefolder", fm_tree, out, model=EXACT,
                        data={**NO_MIX, "micro_batch_size": 8}, parallel={"strategy": strategy},
                        schedule={"max_steps": 4})
        res = run_ranks(r, env={"CONVIT_SCALE_NAN_AT_STEP": where})
        assert res.returncode == 0, res.stderr[-3000:]
        recs = records(out)
        assert recs[1]["loss"] is None and recs[-1]["skipped_steps"] == 1
        got[where] = [x["loss"] for x in recs]
    assert got["1:0"] == got["1:1"] and all(math.isfinite(x) for i, x in enumerate(got["1:1"]) if i != 1)


def _torchrun(recipe, *overrides):
    return subprocess.Popen(ranks_cmd(recipe, *overrides), cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, env={**os.environ, "OMP_NUM_THREADS": "1"})


def _wait_for_steps(out, n, proc, timeout=180):
    t0 = time.time()
    while len(records(out)) < n:
        assert proc.poll() is None, proc.stdout.read()[-3000:]
        assert time.time() - t0 < timeout
        time.sleep(0.2)


def _workers(proc):
    import psutil

    return [c for c in psutil.Process(proc.pid).children(recursive=True) if "convit_scale.train" in " ".join(c.cmdline())]


@pytest.mark.slow
def test_stop_signal_saves_and_exits_for_requeue_then_resumes(fm_tree, tmp_path):
    r = tiny_recipe(tmp_path / "r.yaml", "imagefolder", fm_tree, tmp_path / "out", schedule={"max_steps": 200})
    proc = _torchrun(r)
    _wait_for_steps(tmp_path / "out", 2, proc)
    for w in _workers(proc):  # Slurm's --signal=USR1@T reaches every task
        w.send_signal(signal.SIGUSR1)
    proc.wait(timeout=120)
    assert proc.returncode != 0
    stopped = records(tmp_path / "out", "stopped")
    assert len(stopped) == 1 and (tmp_path / "out" / "STOPPED_FOR_REQUEUE").is_file()
    step = stopped[0]["step"]
    res = run_ranks(r, f"schedule.max_steps={step + 2}")
    assert res.returncode == 0, res.stderr[-3000:]
    assert f"at step {step}" in res.stdout
    assert records(tmp_path / "out", "end")[0]["step"] == step + 2
    assert not (tmp_path / "out" / "STOPPED_FOR_REQUEUE").exists()


@pytest.mark.slow
def test_a_killed_rank_ends_the_job(fm_tree, tmp_path):
    r = tiny_recipe(tmp_path / "r.yaml", "imagefolder", fm_tree, tmp_path / "out", schedule={"max_steps": 500})
    proc = _torchrun(r)
    _wait_for_steps(tmp_path / "out", 2, proc)
    victim = max(_workers(proc), key=lambda p: p.pid)
    victim.kill()
    t0 = time.time()
    proc.wait(timeout=120)
    assert proc.returncode != 0 and time.time() - t0 < 120  # the survivor did not hang


def test_bad_recipe_is_refused_before_any_process(tmp_path, fm_tree, fm_wds):
    r = tiny_recipe(tmp_path / "r.yaml", "imagefolder", fm_tree, tmp_path / "out", parallel={"strategy": "zero9"})
    res = run_cli("train", "--recipe", str(r), "--nproc-per-node", "2")
    assert res.returncode == 2 and "parallel.strategy = 'zero9' is not allowed" in res.stderr
    assert "torch.distributed" not in res.stderr and not (tmp_path / "out").exists()
    r = tiny_recipe(tmp_path / "r2.yaml", "imagefolder", tmp_path / "nowhere", tmp_path / "out")
    res = run_cli("train", "--recipe", str(r), "--nproc-per-node", "2")
    assert res.returncode == 2 and "does not exist" in res.stderr
    r = tiny_recipe(tmp_path / "r3.yaml", "wds", fm_wds, tmp_path / "out", data={"subset_fraction": 0.5})
    res = run_cli("train", "--recipe", str(r), "--nproc-per-node", "2")
    assert res.returncode == 2 and "shards hold subset_fraction=1.0, the recipe asks 0.5" in res.stderr
    assert "torch.distributed" not in res.stderr and not (tmp_path / "out").exists()


def test_tensorboard_events_match_metrics(fm_tree, tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    r = tiny_recipe(tmp_path / "r.yaml", "imagefolder", fm_tree, tmp_path / "out", parallel={"strategy": "none"},
                    schedule={"max_steps": 3}, log={"tensorboard": True}, data={"val_path": ""})
    res = run_cli("train", "--recipe", str(r))
    assert res.returncode == 0, res.stderr[-3000:]
    acc = EventAccumulator(str(tmp_path / "out" / "tensorboard"))
    acc.Reload()
    tb_loss = [(e.step, e.value) for e in acc.Scalars("train/loss")]
    assert [(x["step"], pytest.approx(x["loss"], rel=1e-6)) for x in records(tmp_path / "out")] == tb_loss
    assert {"train/lr", "train/images_per_s", "train/peak_mem_mb/0"} <= set(acc.Tags()["scalars"])


@pytest.mark.slow
def test_export_loads_into_plain_model(fm_tree, tmp_path):
    from convit_scale.models import load_pretrained
    from convit_scale.trained import consolidate

    r = tiny_recipe(tmp_path / "r.yaml", "imagefolder", fm_tree, tmp_path / "out", parallel={"strategy": "zero3"},
                    schedule={"max_steps": 2})
    assert run_ranks(r).returncode == 0
    ckpt = tmp_path / "out" / "checkpoints" / "step_000000002"
    res = run_cli("export", "--checkpoint", str(ckpt), "--out", str(tmp_path / "m.safetensors"))
    assert res.returncode == 0, res.stderr[-2000:]
    model = create_model("convit_nano", num_classes=10, pretrained_file=str(tmp_path / "m.safetensors"))
    fresh = create_model("convit_nano", num_classes=10)
    assert not torch.equal(model.head.weight, fresh.head.weight)  # trained weights, not the init
    state = consolidate(ckpt)
    load_pretrained(fresh, state)
    assert torch.equal(fresh.head.weight, model.head.weight)


@pytest.mark.slow
@pytest.mark.parametrize("strategy,precision", [("fsdp2", "bf16"), ("ddp", "bf16"), ("ddp", "fp16"), ("zero2", "fp16")])
def test_low_precision_clipping_and_keep_last(fm_tree, tmp_path, reference_losses, strategy, precision):
    """bf16 (FSDP2's MixedPrecisionPolicy / DDP's autocast) and fp16 (DDP's autocast with a GradScaler,
    DeepSpeed's fp16 weights with dynamic loss scaling) track fp32; clipping reports the unclipped
    norm; only the newest K checkpoints are kept."""
    if strategy.startswith("zero") and precision == "fp16" and not torch.cuda.is_available() \
            and not torch.ops.mkldnn._is_mkldnn_fp16_supported():
        pytest.skip("DeepSpeed refuses fp16 on a CPU without fp16 support (AVX512-FP16/AMX); make gpu-test covers it")
    r = tiny_recipe(tmp_path / "r.yaml", "imagefolder", fm_tree, tmp_path / "out", model=EXACT, data=NO_MIX,
                    parallel={"strategy": strategy, "precision": precision}, optim={"grad_clip": 0.5},
                    checkpoint={"every_steps": 1, "keep_last": 2}, schedule={"max_steps": 4})
    res = run_ranks(r)
    assert res.returncode == 0, res.stderr[-3000:]
    recs = records(tmp_path / "out")
    for got, ref in zip([x["loss"] for x in recs], reference_losses):
        assert abs(got - ref) < 0.05  # bf16 rounding, same data and init
    assert any(x["grad_norm"] > 0.5 for x in recs)  # the norm before clipping is what is logged
    names = sorted(p.name for p in (tmp_path / "out" / "checkpoints").iterdir())
    assert names == ["step_000000003", "step_000000004"]
