"""Unequal shares of the canonical groups: a recipe of 4 groups trains on 3 ranks (rank 0 holds 2 groups, ranks 1 and
2 one each), with the loss and the gradient weighted by the samples each rank holds, and its per-step losses and
global batches are those of the same recipe on 1 rank (FSDP2 with accumulation, where ranks 1 and 2 repeat their
micro-batch with weight 0, and DDP and ZeRO-2 without it); a run stopped on 4 ranks resumes on 3 and continues the same
run.

Two launches (4 ranks, then 3); the 1-rank references run in this process.
"""

from __future__ import annotations

import pytest
from support import losses, records, run_many, tiny_recipe, train_here

STOP, TOTAL = 2, 6
"""The 4-rank run stops after step 2 (a checkpoint); every run is compared over TOTAL steps."""


def _recipe(tmp, name: str, path, steps: int, strategy: str, micro: int | None, **parallel):
    """The tiny recipe (RandAugment, Mixup, CutMix, drop-path on) with 4 canonical groups of 8, at a learning rate
    (0.03 from the first step) that makes a step taken with wrongly weighted gradients show in the next losses."""
    return tiny_recipe(tmp / f"{name}.yaml", "imagefolder", path, tmp / name,
                       parallel={"strategy": strategy, **parallel},
                       data={"val_path": "", "canonical_groups": 4, "micro_batch_size": micro},
                       optim={"base_lr": 0.5}, schedule={"max_steps": steps, "warmup_epochs": 0},
                       checkpoint={"every_steps": STOP, "keep_last": 5},
                       log={"debug_samples": True})


@pytest.fixture(scope="module")
def unequal(fm_tree, tmp_path_factory):
    """{name: (output folder, status)} of every run of this file."""
    tmp = tmp_path_factory.mktemp("unequal")
    runs = {}
    for name, strategy, micro in (("full1-fsdp2", "fsdp2", 8), ("full1-ddp", "ddp", None),
                                  ("full1-zero2", "zero2", None)):
        runs[name] = train_here(_recipe(tmp, name, fm_tree, TOTAL, strategy, micro))
    part = _recipe(tmp, "part4-fsdp2", fm_tree, STOP, "fsdp2", 8, hsdp_replicas=2)  # 2 x 2 on 4 ranks
    runs["part4-fsdp2"] = run_many([{"recipe": part}], tmp / "launch4", nproc=4)[0]
    three = [{"recipe": _recipe(tmp, "full3-fsdp2", fm_tree, TOTAL, "fsdp2", 8)},
             {"recipe": _recipe(tmp, "full3-ddp", fm_tree, TOTAL, "ddp", None)},
             {"recipe": _recipe(tmp, "full3-zero2", fm_tree, TOTAL, "zero2", None)},
             {"recipe": part, "overrides": [f"schedule.max_steps={TOTAL}"]}]
    statuses = run_many(three, tmp / "launch3", nproc=3)
    runs.update(zip(("full3-fsdp2", "full3-ddp", "full3-zero2", "part4-fsdp2-on3"), statuses))
    return {name: (tmp / name.removesuffix("-on3"), status) for name, status in runs.items()}


def _assert_same_run(got_dir, want_dir, tolerance: float = 1e-5):
    """Per-step losses within ``tolerance`` (relative, as the elastic resume's) and the same global batches."""
    got, want = losses(got_dir), losses(want_dir)
    assert len(got) == len(want) == TOTAL
    for step, (a, b) in enumerate(zip(got, want), 1):
        assert abs(a - b) <= tolerance * abs(b), f"step {step}: {a} vs {b}"
    ids = [(r["step"], r["ids"]) for r in records(got_dir, "samples")]
    assert ids == [(r["step"], r["ids"]) for r in records(want_dir, "samples")] and len(ids) == TOTAL
    assert all(len(batch) == 32 and len(set(batch)) == 32 for _, batch in ids)


@pytest.mark.slow
@pytest.mark.parametrize("strategy", ("fsdp2", "ddp", "zero2"))
def test_three_ranks_holding_four_groups_unequally_train_the_one_rank_run(unequal, strategy):
    """FSDP2: micro-batches of one group, 4 on 1 rank and 2 on each of 3 (ranks 1 and 2 repeat theirs, weight 0);
    DDP and DeepSpeed ZeRO-2 (its own gradient averaging): one micro-batch a step, of 16 samples on rank 0 and 8 on
    the others."""
    for name in (f"full1-{strategy}", f"full3-{strategy}"):
        assert unequal[name][1] == 0, name
    out = unequal[f"full3-{strategy}"][0]
    log = (out.parent / "launch3" / "output.txt").read_text()
    assert "3 ranks hold 4 canonical groups unequally: 1 rank x 2, 2 x 1; step time as for 2 ranks x 2" in log
    _assert_same_run(out, unequal[f"full1-{strategy}"][0])


@pytest.mark.slow
def test_four_ranks_stopped_resume_on_three(unequal):
    """Stopped on 4 ranks as HSDP 2 x 2 (parallel.hsdp_replicas = 2), resumed on 3 ranks (one node of 3), where 2
    replicas do not fit: one replica per node instead, said in the log, and the run goes on."""
    for name in ("full1-fsdp2", "part4-fsdp2", "part4-fsdp2-on3"):
        assert unequal[name][1] == 0, name
    out = unequal["part4-fsdp2-on3"][0]
    log = (out.parent / "launch3" / "output.txt").read_text()
    assert f"resumed step {STOP} from 4 rank(s) on 3" in log
    assert "parallel.hsdp_replicas = 2 does not fit 3 ranks of 3 per node: 1 replica(s), one per node, instead" in log
    _assert_same_run(out, unequal["full1-fsdp2"][0])
