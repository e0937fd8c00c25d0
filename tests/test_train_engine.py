"""The engine on 2 ranks (real gloo, FSDP2 and DeepSpeed): every strategy against one process on the same global
batch, low precision, non-finite steps, sharded memory, export, the epoch analysis, resume across processes.

Most 2-rank runs here share one launch (``shared``: tests/rank_runs.py runs them one after another in the same
two ranks), so that the suite pays the ranks' start-up once; what needs a process of its own (a resume, which a
requeue does in a new process, a signal, a kill) has it.
"""

from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import time

import pytest
import torch
from support import REPO, losses, ranks_cmd, records, run_many, tiny_recipe, train_here

from convit_scale.models import create_model

EXACT = {"drop_path_rate": 0.0}
NO_MIX = {"mixup": 0.0, "cutmix": 0.0}

MATCH = {  # parallel options and micro-batch of the 2-rank runs compared with one process
    "ddp": ({"strategy": "ddp"}, None),  # plain FSDP2 against the reference: test_fsdp2_resumes_from_two_ranks_onto_one
    "fsdp2-accum-ckpt": ({"strategy": "fsdp2", "activation_checkpointing": True, "reshard_after_forward": False}, 8),
    "hsdp": ({"strategy": "fsdp2", "hsdp_replicas": 2}, None),  # replicate across 2 groups of 1 shard
    "fsdp2-meta": ({"strategy": "fsdp2", "meta_init": True, "activation_checkpointing": True}, None),
    "zero1": ({"strategy": "zero1"}, None),
    "zero2-accum": ({"strategy": "zero2"}, 8),  # DeepSpeed's own gradient accumulation
    "zero3-subgroups": ({"strategy": "zero3", "zero_bucket_elements": 8000}, None),  # several optimizer sub-groups
    "zero3-offload": ({"strategy": "zero3", "zero_offload": True}, None),  # DeepSpeed's CPU Adam on the host
    "fsdp2-compile-ckpt": ({"strategy": "fsdp2", "compile": True, "activation_checkpointing": True}, None),
}
LOW_PRECISION = [("fsdp2", "bf16"), ("ddp", "bf16"), ("ddp", "fp16"), ("zero2", "fp16")]


def _fp16_deepspeed_runs_here() -> bool:
    return torch.cuda.is_available() or torch.ops.mkldnn._is_mkldnn_fp16_supported()


def _shared_plan(tmp, fm_tree) -> list[dict]:
    def run(name, env=None, overrides=(), **sections):
        recipe = tiny_recipe(tmp / f"{name}.yaml", "imagefolder", fm_tree, tmp / name, **sections)
        return {"recipe": recipe, "env": env or {}, "overrides": list(overrides), "name": name}

    # first: the live-tensor count walks the whole process, and a ZeRO engine is freed only when the next one starts
    plan = [run(f"memory-{s}", model={"name": "convit_tiny", "img_size": 32}, data={"global_batch_size": 4},
                 parallel={"strategy": s, **({"zero_bucket_elements": 100_000} if s == "zero3" else {})},
                 schedule={"max_steps": 2}, checkpoint={"every_steps": 100}, log={"debug_memory": True})
             for s in ("fsdp2", "zero3")]
    plan += [run(f"match-{k}", model=EXACT, data={**NO_MIX, "micro_batch_size": micro},
                parallel=p, schedule={"max_steps": 4}) for k, (p, micro) in MATCH.items()]
    plan += [run(f"low-{s}-{p}", model=EXACT, data=NO_MIX, parallel={"strategy": s, "precision": p},
                 optim={"grad_clip": 0.5}, checkpoint={"every_steps": 1, "keep_last": 2}, schedule={"max_steps": 4})
             for s, p in LOW_PRECISION if not (s == "zero2" and p == "fp16" and not _fp16_deepspeed_runs_here())]
    plan += [run(f"nan-{s}-{where.replace(':', '_')}", env={"CONVIT_SCALE_NAN_AT_STEP": where}, model=EXACT,
                 data={**NO_MIX, "micro_batch_size": 8}, parallel={"strategy": s}, schedule={"max_steps": 4})
             for s in ("ddp", "zero2") for where in ("1:0", "1:1")]
    plan += [run(f"inf-{s}", env={"CONVIT_SCALE_INF_GRAD_AT_STEP": "2"}, model=EXACT,
                 data={**NO_MIX, "micro_batch_size": 8, "val_path": ""}, parallel={"strategy": s},
                 schedule={"max_steps": 4}, log={"debug_digest": True}) for s in ("ddp", "fsdp2", "zero2", "zero3")]
    plan += [run("policy-skip", env={"CONVIT_SCALE_NAN_AT_STEP": "1"}, schedule={"max_steps": 4}),
             run("policy-stop", env={"CONVIT_SCALE_NAN_AT_STEP": "2"}, schedule={"max_steps": 6},
                 run={"nonfinite_policy": "stop"}, checkpoint={"every_steps": 1, "keep_last": 5})]
    plan += [run("export", parallel={"strategy": "zero3"}, schedule={"max_steps": 2}),
             run("resharded", model=EXACT, data=NO_MIX, schedule={"max_steps": 2}),
             run("analysis-two", model=EXACT, data=NO_MIX, parallel={"strategy": "ddp"}, schedule={"max_steps": 3}),
             run("stop-in-eval", env={"CONVIT_SCALE_SIGNAL_IN_EVAL": "0:1"}, data={"subset_fraction": 0.1},
                 schedule={"max_steps": 5}),
             run("stop-at-epoch-end", env={"CONVIT_SCALE_SIGNAL_AT_EPOCH_END": "0:1"}, data={"subset_fraction": 0.1},
                 schedule={"max_steps": 5})]
    return plan


@pytest.fixture(scope="module")
def shared(fm_tree, tmp_path_factory):
    """The 2-rank runs of this file that need nothing but their own output folder: one launch for all of them."""
    tmp = tmp_path_factory.mktemp("shared")
    plan = _shared_plan(tmp, fm_tree)
    statuses = run_many(plan, tmp / "launch")
    return {r["name"]: (tmp / r["name"], status) for r, status in zip(plan, statuses)}


@pytest.fixture(scope="module")
def reference_losses(fm_tree, tmp_path_factory):
    """One process (in this one), strategy none, the whole global batch in one micro-batch."""
    d = tmp_path_factory.mktemp("ref")
    r = tiny_recipe(d / "r.yaml", "imagefolder", fm_tree, d / "out", model=EXACT, data=NO_MIX,
                    parallel={"strategy": "none"}, schedule={"max_steps": 4})
    assert train_here(r) == 0
    got = losses(d / "out")
    assert len(got) == 4 and all(math.isfinite(x) for x in got)
    return got


@pytest.mark.slow
@pytest.mark.parametrize("name", list(MATCH))
def test_two_ranks_match_single_process(shared, reference_losses, name):
    out, status = shared[f"match-{name}"]
    assert status == 0
    micro = MATCH[name][1]
    assert (out / "config.yaml").is_file()
    got = losses(out)
    assert len(got) == 4 and records(out, "end")[0]["step"] == 4
    if MATCH[name][0].get("meta_init"):  # initialised shard by shard: another random init, so only sanity here
        assert all(math.isfinite(x) for x in got) and abs(got[0] - reference_losses[0]) < 0.5
        return
    for a, b in zip(got, reference_losses):
        assert abs(a - b) < 1e-5, (name, micro, got, reference_losses)


@pytest.mark.slow
@pytest.mark.parametrize("strategy,precision", LOW_PRECISION)
def test_low_precision_clipping_and_keep_last(shared, reference_losses, strategy, precision):
    """bf16 (FSDP2's MixedPrecisionPolicy / DDP's autocast) and fp16 (DDP's autocast with a GradScaler,
    DeepSpeed's fp16 weights with dynamic loss scaling) track fp32; clipping reports the unclipped
    norm; only the newest K checkpoints are kept."""
    if f"low-{strategy}-{precision}" not in shared:
        pytest.skip("DeepSpeed refuses fp16 on a CPU without fp16 support (AVX512-FP16/AMX); make gpu-test covers it")
    out, status = shared[f"low-{strategy}-{precision}"]
    assert status == 0
    recs = records(out)
    for got, ref in zip([x["loss"] for x in recs], reference_losses):
        assert abs(got - ref) < 0.05  # bf16 rounding, same data and init
    assert any(x["grad_norm"] > 0.5 for x in recs)  # the norm before clipping is what is logged
    names = sorted(p.name for p in (out / "checkpoints").glob("step_*"))
    assert names == ["step_000000003", "step_000000004"]
    assert (out / "checkpoints" / "latest").read_text().strip() == "step_000000004"


@pytest.mark.slow
@pytest.mark.parametrize("strategy", ["ddp", "zero2"])
def test_nan_in_a_later_micro_batch_discards_the_whole_step(shared, strategy):
    """Accumulation 2: a NaN in the second micro-batch of step 1 discards the first one's gradients too
    (DDP's and DeepSpeed's): the run goes on exactly as when the NaN is in the first micro-batch."""
    got = {}
    for where in ("1_0", "1_1"):
        out, status = shared[f"nan-{strategy}-{where}"]
        assert status == 0
        recs = records(out)
        assert recs[1]["loss"] is None and recs[-1]["skipped_steps"] == 1
        got[where] = [x["loss"] for x in recs]
    assert got["1_0"] == got["1_1"] and all(math.isfinite(x) for i, x in enumerate(got["1_1"]) if i != 1)


@pytest.mark.slow
@pytest.mark.parametrize("strategy", ["ddp", "fsdp2", "zero2", "zero3"])
def test_inf_gradient_with_finite_loss_leaves_the_state_exactly_on_every_rank(shared, strategy):
    """Accumulation 2; rank 0's gradient of step index 2 is made infinite while its loss stays finite: the step's
    packed reduction makes rank 1, whose own gradients are finite, skip it too. Weights and optimizer state after it
    are bit-identical to those before it on both ranks (digest per rank), and training goes on."""
    out, status = shared[f"inf-{strategy}"]
    assert status == 0
    digests = {d["step"]: d["state_digest"] for d in records(out, "digest")}
    assert sorted(digests) == [1, 2, 3, 4] and all(len(d) == 2 for d in digests.values())
    assert digests[3] == digests[2]  # the bad step changed nothing, on either rank
    assert digests[4] != digests[3] and digests[2] != digests[1]  # good steps do change the state
    train = records(out)
    assert [t["skipped_steps"] for t in train] == [0, 0, 1, 1]
    assert train[2]["loss"] is None and train[2]["grad_norm"] is None
    assert all(math.isfinite(t["loss"]) and math.isfinite(t["grad_norm"]) for i, t in enumerate(train) if i != 2)
    assert records(out, "end")[0]["skipped_steps"] == 1


@pytest.mark.slow
def test_nan_policy_skip_and_stop(shared):
    out, status = shared["policy-skip"]
    assert status == 0
    recs = records(out)
    assert recs[1]["loss"] is None and recs[1]["skipped_steps"] == 1 and recs[-1]["skipped_steps"] == 1
    assert all(math.isfinite(x["loss"]) for i, x in enumerate(recs) if i != 1)
    assert records(out, "end")[0]["skipped_steps"] == 1
    # stop: the good checkpoint of step 2 stays the newest; nothing is written after the NaN
    out, status = shared["policy-stop"]
    assert status == 3
    assert sorted(p.name for p in (out / "checkpoints").glob("step_*")) == ["step_000000001", "step_000000002"]
    assert json.loads((out / "checkpoints" / "step_000000002" / "meta.json").read_text())["step"] == 2


@pytest.mark.slow
@pytest.mark.parametrize("strategy", ["fsdp2", "zero3"])
def test_sharded_model_state_is_near_the_ideal(shared, strategy):
    """Live tensors per rank before an optimizer step (parameters, gradients, both Adam moments and the
    strategy's persistent buffers) within 1.2x of 16 bytes x parameters / world, at 2 ranks. ZeRO-3 only
    meets it because its fp32 partitions double as the master weights (`share_fp32_master_partitions`)."""
    out, status = shared[f"memory-{strategy}"]
    assert status == 0
    params = sum(p.numel() for p in create_model("convit_tiny", num_classes=10, img_size=32).parameters())
    ideal = 16 * params / 2 / 2**20
    state = records(out)[-1]["state_mem_mb"]
    assert len(state) == 2 and all(0.95 * ideal < s < 1.2 * ideal for s in state), (state, ideal)


@pytest.mark.slow
def test_export_loads_into_plain_model(shared, tmp_path, capsys):
    from convit_scale.cli import main
    from convit_scale.models import load_pretrained
    from convit_scale.trained import consolidate

    out, status = shared["export"]
    assert status == 0
    ckpt = out / "checkpoints" / "step_000000002"
    assert main(["export", "--checkpoint", str(ckpt), "--out", str(tmp_path / "m.safetensors")]) == 0
    model = create_model("convit_nano", num_classes=10, pretrained_file=str(tmp_path / "m.safetensors"))
    fresh = create_model("convit_nano", num_classes=10)
    assert not torch.equal(model.head.weight, fresh.head.weight)  # trained weights, not the init
    load_pretrained(fresh, consolidate(ckpt))
    assert torch.equal(fresh.head.weight, model.head.weight)


@pytest.mark.slow
def test_fsdp2_resumes_from_two_ranks_onto_one(shared, reference_losses, capsys):
    out, status = shared["resharded"]
    assert status == 0
    assert train_here(out.with_suffix(".yaml"), "schedule.max_steps=4") == 0  # one process now
    assert "1 rank(s)" in capsys.readouterr().out
    got = losses(out)
    assert len(got) == 4
    for a, b in zip(got, reference_losses):  # same data position, resharded state
        assert abs(a - b) < 1e-5


@pytest.mark.slow
def test_sharded_epoch_analysis_on_two_ranks_equals_one_rank(shared, fm_tree, tmp_path):
    """Gating and nonlocality of the epoch: each rank measures its share of the validation images on its own
    device; the reduced result equals the one-process computation on the same weights."""
    out, status = shared["analysis-two"]
    assert status == 0
    r = tiny_recipe(tmp_path / "one.yaml", "imagefolder", fm_tree, tmp_path / "one", model=EXACT, data=NO_MIX,
                    parallel={"strategy": "none"}, schedule={"max_steps": 3})
    assert train_here(r) == 0
    (one,), (two,) = records(tmp_path / "one", "analysis"), records(out, "analysis")
    assert one["analysis_images"] == two["analysis_images"] == 200  # the whole (small) validation split
    assert len(one["nonlocality"]) == 3 and all(abs(a - b) < 1e-4
                                                for a, b in zip(one["nonlocality"], two["nonlocality"]))
    assert all(abs(a - b) < 1e-5 for la, lb in zip(one["gating"], two["gating"]) for a, b in zip(la, lb))


@pytest.mark.slow
def test_a_stop_signal_during_the_evaluation_stops_the_run_after_it(shared):
    """Rank 1 is signalled as epoch 0's evaluation begins (its last step's reduction has passed): the run stops
    after the evaluation, saving once there (the stop's checkpoint, in place of the epoch's), not after a step and
    an epoch save more; the checkpoint is the next epoch's start, which a resume begins with."""
    out, status = shared["stop-in-eval"]
    assert status == 75
    last = records(out)[-1]["step"]
    assert [r["epoch"] for r in records(out, "eval")] == [0]
    assert [(r["step"], r["reason"]) for r in records(out, "checkpoint")] == [(last, "signal")]
    assert [r["step"] for r in records(out, "stopped")] == [last]
    meta = json.loads((out / "checkpoints" / f"step_{last:09d}" / "meta.json").read_text())
    assert (meta["epoch"], meta["batch_in_epoch"], meta["reason"]) == (1, 0, "signal")


@pytest.mark.slow
def test_a_stop_signal_before_the_evaluation_stops_the_run_before_it(shared):
    """Rank 1 is signalled as epoch 0 closes, after its last step's reduction (as in a save at that step): the run
    stops at once, its checkpoint the finished epoch's before its evaluation (which a resumed run makes first),
    without spending the signal's lead on the evaluation and analysis."""
    out, status = shared["stop-at-epoch-end"]
    assert status == 75
    last = records(out)[-1]["step"]
    assert records(out, "eval") == [] and records(out, "analysis") == []
    assert [(r["step"], r["reason"]) for r in records(out, "checkpoint")] == [(last, "signal")]
    meta = json.loads((out / "checkpoints" / f"step_{last:09d}" / "meta.json").read_text())
    assert (meta["epoch"], meta["step_in_epoch"], meta["reason"]) == (0, last, "signal")


# -- resume across processes: what a requeue does ---------------------------------------------------------------
RESUMES = {  # name: (format, stop, total, recipe sections)
    # WebDataset with workers and RandAugment, stopped at step 3
    "fsdp2-wds": ("wds", 3, 6, {"data": {"num_workers": 2, "rand_augment": "rand-m9-mstd0.5-inc1"}}),
    # DeepSpeed's own checkpoint, several optimizer sub-groups per rank, partitions shared with the master weights
    "zero3": ("imagefolder", 2, 4, {"parallel": {"strategy": "zero3", "zero_bucket_elements": 8000}}),
}


@pytest.fixture(scope="module")
def resumed(fm_tree, fm_wds, tmp_path_factory):
    """For each of RESUMES: an uninterrupted run of `total` steps ("a") and one stopped at `stop` (its checkpoint,
    "b") in one launch, then every "b" resumed in new processes (a second launch)."""
    tmp = tmp_path_factory.mktemp("resume")
    first, second = [], []
    for name, (fmt, stop, total, kw) in RESUMES.items():
        data = {"wds": fm_wds, "imagefolder": fm_tree}[fmt]
        kw = {**kw, "checkpoint": {"every_steps": stop}}
        full = tiny_recipe(tmp / f"{name}-a.yaml", fmt, data, tmp / name / "a", schedule={"max_steps": total}, **kw)
        part = tiny_recipe(tmp / f"{name}-b.yaml", fmt, data, tmp / name / "b", schedule={"max_steps": stop}, **kw)
        first += [{"recipe": full}, {"recipe": part}]
        second.append({"recipe": part, "overrides": [f"schedule.max_steps={total}"]})
    assert run_many(first, tmp / "first") == [0] * len(first)
    assert run_many(second, tmp / "second") == [0] * len(second)
    return tmp, (tmp / "second" / "output.txt").read_text()


@pytest.mark.slow
@pytest.mark.parametrize("name", list(RESUMES))
def test_resume_is_bit_identical(resumed, name):
    """Stopped and resumed in new processes: the same per-step losses as an uninterrupted run, bit for bit (fp32
    on CPU)."""
    tmp, output = resumed
    _, stop, total, _ = RESUMES[name]
    assert f"resumed from {tmp / name / 'b' / 'checkpoints' / f'step_{stop:09d}'} at step {stop}" in output
    assert f"resumed step {stop} from 2 rank(s) on 2" in output
    assert losses(tmp / name / "b") == losses(tmp / name / "a")
    assert len(losses(tmp / name / "a")) == total


# -- signals and a killed rank ------------------------------------------------------------------------------------
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

    return [c for c in psutil.Process(proc.pid).children(recursive=True)
            if "convit_scale.train" in " ".join(c.cmdline())]


@pytest.mark.slow
def test_stop_signal_saves_and_exits_for_requeue_then_resumes(fm_tree, tmp_path, capsys):
    """Stopped on 2 ranks; resumed in this process (1 rank: the checkpoint is the run's at any world size)."""
    r = tiny_recipe(tmp_path / "r.yaml", "imagefolder", fm_tree, tmp_path / "out", schedule={"max_steps": 200})
    proc = _torchrun(r)
    _wait_for_steps(tmp_path / "out", 2, proc)
    for w in _workers(proc):  # Slurm's --signal=USR1@T reaches every task
        w.send_signal(signal.SIGUSR1)
    output = proc.communicate(timeout=120)[0]
    assert proc.returncode != 0
    assert "[convit-scale] step 2/" in output  # a log line per logged step when not on a terminal
    stopped = records(tmp_path / "out", "stopped")
    assert len(stopped) == 1 and (tmp_path / "out" / "STOPPED_FOR_REQUEUE").is_file()
    step = stopped[0]["step"]
    capsys.readouterr()
    assert train_here(r, f"schedule.max_steps={step + 2}") == 0
    printed = capsys.readouterr().out
    assert f"at step {step}" in printed and f"resumed step {step} from 2 rank(s) on 1" in printed
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


def test_bad_recipe_is_refused_before_any_process(tmp_path, fm_tree, fm_wds, capsys):
    from convit_scale.cli import main

    for r, needle in ((tiny_recipe(tmp_path / "r.yaml", "imagefolder", fm_tree, tmp_path / "out",
                                   parallel={"strategy": "zero9"}), "parallel.strategy = 'zero9' is not allowed"),
                      (tiny_recipe(tmp_path / "r2.yaml", "imagefolder", tmp_path / "nowhere", tmp_path / "out"),
                       "does not exist"),
                      (tiny_recipe(tmp_path / "r3.yaml", "wds", fm_wds, tmp_path / "out",
                                   data={"subset_fraction": 0.5}),
                       "shards hold subset_fraction=1.0, the recipe asks 0.5")):
        assert main(["train", "--recipe", str(r), "--nproc-per-node", "2"]) == 2
        err = capsys.readouterr().err
        assert needle in err and "torch.distributed" not in err and not (tmp_path / "out").exists()


def test_tensorboard_events_match_metrics(fm_tree, tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    r = tiny_recipe(tmp_path / "r.yaml", "imagefolder", fm_tree, tmp_path / "out", parallel={"strategy": "none"},
                    schedule={"max_steps": 3}, log={"tensorboard": True}, data={"val_path": ""})
    assert train_here(r) == 0
    acc = EventAccumulator(str(tmp_path / "out" / "tensorboard"))
    acc.Reload()
    tb_loss = [(e.step, e.value) for e in acc.Scalars("train/loss")]
    assert [(x["step"], pytest.approx(x["loss"], rel=1e-6)) for x in records(tmp_path / "out")] == tb_loss
    assert {"train/lr", "train/images_per_s", "train/peak_mem_mb/0"} <= set(acc.Tags()["scalars"])
