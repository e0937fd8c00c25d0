"""Elastic resume: a run stopped on some number of ranks and resumed on another continues the same run, sample for
sample, with RandAugment, Mixup, CutMix and drop-path on, in every format and in every hand-over mode (FSDP2:
``MODES``) and through DeepSpeed's universal
checkpoint (ZeRO-2, ZeRO-3; in fp32, and in bf16 with the GPU runs' ZeRO settings); a world size above the canonical
groups is refused before any rank starts (unequal shares below it: tests/test_train_unequal.py).

One 2-rank launch in all (``elastic``); the 1-rank runs, and the resumes on 1 rank, run in this process.
"""

from __future__ import annotations

import contextlib
import io
import os
import subprocess
import sys

import pytest
from support import REPO, losses, records, run_many, tiny_recipe, train_here

from convit_scale.config import load_config
from convit_scale.parallel.universal import is_converted
from convit_scale.slurm_scripts import job_scripts

STOP, TOTAL = 3, 13
"""Stopped after step 3 (mid-epoch: 1000 images make 31 steps of 32), compared over the 10 steps after it."""
FORMATS = ("imagefolder", "wds", "ffcv")
MODES = {"imagefolder": {}, "wds": {"decode_on": "device"}, "ffcv": {"resize_on": "device"}}
"""Each format's data path in its FSDP2 runs, so that every hand-over mode resumes on another world size without a
run more: ImageFolder's crops resized and augmented by the loader (the CPU's default; the ZeRO runs too), WebDataset's
JPEGs decoded on the training device (here torchvision's CPU decoder stands in), FFCV's crop boxes resized there;
both augmented there. The loaders' own positions in every format and mode: tests/test_data_handover.py."""
ZERO = ("zero2", "zero3")


def _converts(strategy: str) -> bool:
    """Whether the installed DeepSpeed converts this stage's checkpoints (`make deepspeed-floor`: 0.16.0 cannot, for
    ZeRO-3, and refuses: tests/test_parallel_universal.py)."""
    import deepspeed

    from convit_scale.parallel.universal import universal_problem

    return universal_problem(strategy, deepspeed.__version__) is None


BF16_TOTAL = STOP + 3
"""The bf16 ZeRO cases are compared over 3 steps after STOP: enough to see the resumed state step on."""


def gpu_zero_settings(strategy: str) -> tuple[dict, dict]:
    """(parallel, optim) sections of a ZeRO run as the GPU runs them, on the CPU: bf16, overlapped reduction, ZeRO-3
    parameters under 1e5 elements kept whole (every parameter of convit_nano: only their optimizer state is
    partitioned), and the fused AdamW, whose ``step`` lives on the parameters' device."""
    parallel = {"strategy": strategy, "precision": "bf16", "zero_overlap_comm": True}
    if strategy == "zero3":
        parallel["zero_param_persistence_threshold"] = 100_000
    return parallel, {"fused": True}


def _recipe(tmp, name: str, fmt: str, path, steps: int, strategy: str = "fsdp2", gpu_settings: bool = False):
    """The tiny recipe with the paper's augmentation (RandAugment, Mixup 0.8, CutMix 1.0: the defaults) and
    drop-path 0.1 (tiny_recipe's), 16 canonical groups of 2, every step's global batch logged as sample ids;
    ``gpu_settings``: a ZeRO run with ``gpu_zero_settings``."""
    parallel, optim = gpu_zero_settings(strategy) if gpu_settings else ({"strategy": strategy}, {})
    return tiny_recipe(tmp / f"{name}.yaml", fmt, path, tmp / name, parallel=parallel, optim=optim,
                       data={"val_path": "", "num_workers": 2 if fmt == "wds" else 0, **MODES[fmt]},
                       schedule={"max_steps": steps}, checkpoint={"every_steps": STOP, "keep_last": 10},
                       log={"debug_samples": True})


def _selected(request) -> set[str]:
    """The strategies of this file's selected tests that use ``elastic``: `make deepspeed-floor` selects the ZeRO
    test alone (-k zero), whose runs are then the only ones made."""
    names = [i.originalname for i in request.session.items
             if i.module is request.module and "elastic" in i.fixturenames]
    return {"zero" if "zero" in n else "fsdp2" for n in names}


@pytest.fixture(scope="module")
def elastic(request, fm_tree, fm_wds, fm_ffcv, tmp_path_factory):
    """Every run of this file: {name: (output folder, exit status, printed log of an in-process resume)}. One 2-rank
    launch: the 2-rank runs (uninterrupted, and stopped at STOP) and the resumes on 2 ranks of the 1-rank runs
    stopped at STOP before it, in this process; the resumes on 1 rank of the stopped 2-rank runs after it."""
    tmp = tmp_path_factory.mktemp("elastic")
    data = {"imagefolder": fm_tree, "wds": fm_wds, "ffcv": fm_ffcv}
    selected = _selected(request)
    fsdp2 = FORMATS if "fsdp2" in selected else ()
    cases = [(fmt, "fsdp2") for fmt in fsdp2] + [("imagefolder", z) for z in (ZERO if "zero" in selected else ())
                                                 if _converts(z)]
    grow = [(fmt, "fsdp2") for fmt in fsdp2] + [("imagefolder", "zero2")] * ("zero" in selected)  # 1 -> 2
    bf16 = [z for z in ZERO if "zero" in selected and _converts(z)]  # with the GPU runs' ZeRO settings
    runs = {f"part1-{fmt}-{strategy}": (train_here(_recipe(tmp, f"part1-{fmt}-{strategy}", fmt, data[fmt], STOP,
                                                           strategy)), "")
            for fmt, strategy in grow}  # 1 rank, stopped at STOP
    two = [{"recipe": _recipe(tmp, f"{kind}2-{fmt}-{strategy}", fmt, data[fmt], steps, strategy)}
           for fmt, strategy in cases for kind, steps in (("full", TOTAL), ("part", STOP))]
    two += [{"recipe": _recipe(tmp, f"{kind}2-imagefolder-{z}-bf16", "imagefolder", fm_tree, steps, z, True)}
            for z in bf16 for kind, steps in (("full", BF16_TOTAL), ("part", STOP))]
    two += [{"recipe": tmp / f"part1-{fmt}-{strategy}.yaml", "overrides": [f"schedule.max_steps={TOTAL}"], "on": 2}
            for fmt, strategy in grow]
    for r, status in zip(two, run_many(two, tmp / "launch")):
        runs[r["recipe"].stem + ("-on2" if "on" in r else "")] = (status, "")
    back = [(f"part2-{fmt}-{strategy}", TOTAL) for fmt, strategy in cases]
    back += [(f"part2-imagefolder-{z}-bf16", BF16_TOTAL) for z in bf16]
    for name, total in back:  # 2 -> 1, in this process (a requeue's new process would do the same)
        printed = io.StringIO()
        with contextlib.redirect_stdout(printed):
            status = train_here(tmp / f"{name}.yaml", f"schedule.max_steps={total}")
        runs[f"{name}-on1"] = (status, printed.getvalue())
    return {name: (tmp / name.removesuffix("-on1").removesuffix("-on2"), status, printed)
            for name, (status, printed) in runs.items()}


def _assert_continues(resumed, full, total: int = TOTAL, tolerance: float = 1e-5):
    """The resumed run's steps after STOP: per-step losses within ``tolerance`` (relative) of the uninterrupted run's,
    and every step's global batch the same sample ids, in the same canonical order."""
    got, want = losses(resumed), losses(full)
    assert len(got) == len(want) == total
    for step, (a, b) in enumerate(zip(got, want), 1):
        assert abs(a - b) <= tolerance * abs(b), f"step {step}: {a} resumed, {b} uninterrupted"
    ids = [(r["step"], r["ids"]) for r in records(resumed, "samples")]
    assert ids == [(r["step"], r["ids"]) for r in records(full, "samples")] and len(ids) == total
    assert all(len(batch) == 32 and len(set(batch)) == 32 for _, batch in ids)


@pytest.mark.slow
@pytest.mark.parametrize("fmt", FORMATS)
def test_fsdp2_two_ranks_stopped_mid_epoch_resume_on_one(elastic, fmt):
    for name in (f"full2-{fmt}-fsdp2", f"part2-{fmt}-fsdp2", f"part2-{fmt}-fsdp2-on1"):
        assert elastic[name][1] == 0, name
    out, _, printed = elastic[f"part2-{fmt}-fsdp2-on1"]
    assert f"resumed step {STOP} from 2 rank(s) on 1" in printed
    _assert_continues(out, elastic[f"full2-{fmt}-fsdp2"][0])


@pytest.mark.slow
@pytest.mark.parametrize("fmt", FORMATS)
def test_fsdp2_one_rank_stopped_mid_epoch_resumes_on_two(elastic, fmt):
    """Compared with the uninterrupted run on 2 ranks: the run is the recipe's, whatever the world size (1 rank up to
    STOP, 2 after it, give the 2-rank run's samples and losses)."""
    for name in (f"full2-{fmt}-fsdp2", f"part1-{fmt}-fsdp2", f"part1-{fmt}-fsdp2-on2"):
        assert elastic[name][1] == 0, name
    out = elastic[f"part1-{fmt}-fsdp2-on2"][0]
    checkpoint = out / "checkpoints" / f"step_{STOP:09d}"
    assert any(f"resumed from {checkpoint} at step {STOP}" in line
               and f"resumed step {STOP} from 1 rank(s) on 2" in line
               for line in (out.parent / "launch" / "output.txt").read_text().splitlines())
    _assert_continues(out, elastic[f"full2-{fmt}-fsdp2"][0])


@pytest.mark.slow
@pytest.mark.parametrize("strategy", ZERO)
def test_zero_two_ranks_resume_on_one_through_the_universal_checkpoint(elastic, strategy):
    if not _converts(strategy):
        pytest.skip(f"this DeepSpeed refuses to convert {strategy} checkpoints (tests/test_parallel_universal.py)")
    for name in (f"full2-imagefolder-{strategy}", f"part2-imagefolder-{strategy}",
                 f"part2-imagefolder-{strategy}-on1"):
        assert elastic[name][1] == 0, name
    out, _, printed = elastic[f"part2-imagefolder-{strategy}-on1"]
    assert f"resumed step {STOP} from 2 rank(s) on 1" in printed
    checkpoint = out / "checkpoints" / f"step_{STOP:09d}"
    assert is_converted(checkpoint / "universal") and not (checkpoint / "universal.tmp").exists()  # converted once
    _assert_continues(out, elastic[f"full2-imagefolder-{strategy}"][0])


@pytest.mark.slow
@pytest.mark.parametrize("strategy", ZERO)
def test_zero_bf16_with_the_gpu_settings_resumes_on_one_through_the_universal_checkpoint(elastic, strategy):
    """The production universal path: bf16, overlapped reduction, ZeRO-3's small parameters kept whole, the fused
    AdamW (its ``step`` on the parameters' device after the load). Stopped on 2 ranks, resumed on 1: the same samples,
    and losses within 1e-3 of the uninterrupted run's (bf16: 1 and 2 ranks round their products apart; 1e-5 seen)."""
    if not _converts(strategy):
        pytest.skip(f"this DeepSpeed refuses to convert {strategy} checkpoints (tests/test_parallel_universal.py)")
    name = f"imagefolder-{strategy}-bf16"
    for run in (f"full2-{name}", f"part2-{name}", f"part2-{name}-on1"):
        assert elastic[run][1] == 0, run
    out, _, printed = elastic[f"part2-{name}-on1"]
    assert f"resumed step {STOP} from 2 rank(s) on 1" in printed
    assert is_converted(out / "checkpoints" / f"step_{STOP:09d}" / "universal")
    _assert_continues(out, elastic[f"full2-{name}"][0], BF16_TOTAL, 1e-3)


@pytest.mark.slow
def test_zero_one_rank_resumes_on_two_through_the_universal_checkpoint(elastic):
    """Rank 0 converts while rank 1 waits for it (in a gloo group of its own, past the process group's timeout
    when the conversion is long: tests/test_comm.py), then both load their new partitions."""
    for name in ("full2-imagefolder-zero2", "part1-imagefolder-zero2", "part1-imagefolder-zero2-on2"):
        assert elastic[name][1] == 0, name
    out = elastic["part1-imagefolder-zero2-on2"][0]
    checkpoint = out / "checkpoints" / f"step_{STOP:09d}"
    assert any(f"resumed from {checkpoint} at step {STOP}" in line
               and f"resumed step {STOP} from 1 rank(s) on 2" in line
               for line in (out.parent / "launch" / "output.txt").read_text().splitlines())
    assert is_converted(checkpoint / "universal") and not (checkpoint / "universal.tmp").exists()
    _assert_continues(out, elastic["full2-imagefolder-zero2"][0])


def test_a_world_size_above_the_canonical_groups_is_refused_before_any_rank(fm_tree, tmp_path, capsys):
    from convit_scale.cli import main

    r = tiny_recipe(tmp_path / "r.yaml", "imagefolder", fm_tree, tmp_path / "out")  # batch 32: 16 groups of 2
    assert main(["train", "--recipe", str(r), "--nproc-per-node", "17"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["error: 17 ranks exceed the 16 canonical groups of data.global_batch_size = 32 "
                   "(data.canonical_groups = 16; each rank holds at least one whole group): at most 16 ranks"]
    assert not (tmp_path / "out").exists()


def test_a_slurm_job_given_more_ranks_than_canonical_groups_is_refused_before_srun(tmp_path):
    """``sbatch --nodes=2-5 slurm/convit_b_plus.sh`` started on 5 nodes of 8: 40 ranks exceed ConViT-B+'s 32
    canonical groups; the batch shell says so in one line and exits 2 before any srun (no Slurm needed to see it).
    3 of its 4 nodes (24 ranks) are allowed: unequal shares (tests/test_train_unequal.py)."""
    env = {**os.environ, "RECIPE": str(REPO / "recipes/table1/convit_base_plus.yaml"),
           "OUTPUT_DIR": str(tmp_path / "run"), "PYTHON": sys.executable, "MASTER_ADDR": "127.0.0.1",
           "SLURM_JOB_NUM_NODES": "5", "SLURM_NTASKS_PER_NODE": "8", "SITE_SCRIPT": str(tmp_path / "site.sh")}
    (tmp_path / "site.sh").write_text("")
    res = subprocess.run(["bash", str(REPO / "slurm" / "launch.sh")], capture_output=True, text=True, cwd=REPO,
                         env=env, timeout=120)
    assert res.returncode == 2, res
    assert res.stderr.strip() == ("error: 40 ranks exceed the 32 canonical groups of data.global_batch_size = 512 "
                                  "(data.canonical_groups = 32; each rank holds at least one whole group): at most "
                                  "32 ranks")
    assert "== nodes 5, tasks/GPUs per node 8" in res.stdout and not (tmp_path / "run").exists()


def test_a_slurm_job_without_its_data_is_refused_before_srun(tmp_path):
    """``DATA_DIR=<a folder without data> sbatch slurm/convit_b_plus.sh``: the batch shell reads the folder's
    manifest, as every rank's preflight would, and refuses in one line naming DATA_DIR and what the recipe reads,
    before the training srun (not in its 32 ranks). An srun on PATH stands guard: it is never reached."""
    guard = tmp_path / "bin" / "srun"
    guard.parent.mkdir()
    guard.write_text(f"#!/bin/sh\necho srun reached >> {tmp_path / 'srun.log'}\nexit 97\n")
    guard.chmod(0o755)
    (tmp_path / "site.sh").write_text("")
    data = tmp_path / "imagenet-ffcv"
    data.mkdir()
    env = {**os.environ, "PATH": f"{guard.parent}:{os.environ['PATH']}", "DATA_DIR": str(data),
           "OUTPUT_DIR": str(tmp_path / "run"), "PYTHON": sys.executable, "MASTER_ADDR": "127.0.0.1",
           "SLURM_JOB_NUM_NODES": "4",
           "SLURM_NTASKS_PER_NODE": "8", "SITE_SCRIPT": str(tmp_path / "site.sh")}
    res = subprocess.run(["bash", str(REPO / "slurm" / "convit_b_plus.sh")], capture_output=True, text=True,
                         cwd=REPO, env=env, timeout=120)
    assert res.returncode == 2, res
    assert res.stderr.strip() == (
        f"error: DATA_DIR={data}: {data}: no manifest.json (not found); convert with `convit-scale prep`, or, for "
        f"WebDataset shards another tool wrote, give the folder timm's _info.json; expected ffcv data (data.format): "
        f"a folder that `convit-scale prep ffcv` wrote (manifest.json), or .ffcv/.beton files")
    assert not (tmp_path / "srun.log").exists() and not (tmp_path / "run").exists()


JOB_SCRIPTS = job_scripts(REPO / "slurm")


@pytest.mark.parametrize("script", JOB_SCRIPTS, ids=lambda s: s.path.stem)
def test_every_slurm_script_runs_its_recipe_on_its_own_gpus(script):
    """The job shape each script asks for is a world size its recipe allows (no more ranks than canonical groups)."""
    cfg = load_config(REPO / script.recipe, [])
    assert cfg.data.world_size_problem(script.nodes * script.tasks_per_node) is None
