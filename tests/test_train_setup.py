"""One rank's set-up (convit_scale/train/setup.py), in a real one-rank group as the engine calls it: the global batch
cut into micro-batches and accumulation, the peak learning rate scaled by the global batch, the schedule's length
from the loader, the resolved config in the run folder, and the model's initial weights a function of the seed."""

from __future__ import annotations

import torch
from support import one_rank_group, tiny_recipe

from convit_scale.config import load_config
from convit_scale.train.setup import build_model, setup
from convit_scale.train.signals import StopSignal


def test_the_run_set_up_from_the_recipe(fm_wds, tmp_path):
    recipe = tiny_recipe(tmp_path / "r.yaml", "wds", fm_wds, tmp_path / "out", parallel={"strategy": "ddp"})
    cfg = load_config(recipe, ["data.micro_batch_size=16", "optim.base_lr=5e-4", "schedule.epochs=3",
                               "schedule.max_steps=70"])
    stop = StopSignal()
    try:
        with one_rank_group(torch.device("cpu")) as ctx:
            run, state = setup(cfg, ctx, stop)
            try:
                assert (run.micro, run.accum) == (16, 2)  # global batch 32 on 1 rank, micro-batches of 16
                assert run.lr == 5e-4 * 32 / cfg.optim.lr_reference_batch
                assert run.steps_per_epoch == 1000 // 32 and run.total_steps == 70  # min(3 x 31, max_steps)
                assert run.train_loader.num_samples == 1000 and run.val_loader.num_samples == 200
                assert run.mixup is not None and run.teacher is None and state.step == 0  # DeiT's Mixup/CutMix
                assert load_config(tmp_path / "out" / "config.yaml").to_dict() == cfg.to_dict()
            finally:
                run.metrics.close()
                run.strategy.close()
    finally:
        stop.restore()


def test_the_initial_weights_are_a_function_of_the_seed():
    cfg = load_config(None, ["model.name=convit_nano", "model.num_classes=10"])
    first, again = build_model(cfg).state_dict(), build_model(cfg).state_dict()
    assert all(torch.equal(first[k], again[k]) for k in first)
    other = build_model(load_config(None, ["model.name=convit_nano", "model.num_classes=10", "run.seed=1"]))
    assert not torch.equal(other.state_dict()["head.weight"], first["head.weight"])
    meta = build_model(cfg, meta=True)  # parallel.meta_init: shards initialise after sharding
    assert all(p.is_meta for p in meta.parameters())
