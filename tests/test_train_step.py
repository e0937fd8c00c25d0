"""convit_scale/train/step.py: what one optimizer step does, in this process (a one-process group).

On a GPU every host read of a device value and every tensor built on the device from host data is a stream
synchronisation; a step of the package's own code makes exactly one read (the packed reduction's decision) and
builds nothing from host data. The CPU cannot tell host from device tensors, so this counts the calls themselves,
made from the package's step and strategy code (``make gpu-test`` runs a step under CUDA's sync debug mode)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from support import records, tiny_recipe, train_here
from torch.overrides import TorchFunctionMode

import convit_scale
from convit_scale.train import loop

PKG = Path(convit_scale.__file__).parent
WATCHED = (PKG / "train" / "step.py", PKG / "parallel")
HOST_READS = {"item", "tolist", "__float__", "__int__", "__bool__", "numpy"}
FROM_HOST = {"tensor", "as_tensor", "asarray"}
TORCH_DISPATCH = ("torch/overrides.py", "torch/_tensor.py", "torch/utils/_device.py")


class StepCalls(TorchFunctionMode):
    """Host reads and tensors made from host data on an explicit device, called from ``WATCHED`` files."""

    def __init__(self):
        super().__init__()
        self.reads, self.made = [], []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = getattr(func, "__name__", "")
        if name in HOST_READS or (name in FROM_HOST and "device" in kwargs):
            frame = sys._getframe(1)  # the caller, past torch's own dispatch of the override
            while frame is not None and frame.f_code.co_filename.endswith(TORCH_DISPATCH):
                frame = frame.f_back
            where = Path(frame.f_code.co_filename) if frame is not None else None
            if where is not None and any(where == w or w in where.parents for w in WATCHED):
                (self.reads if name in HOST_READS else self.made).append(f"{name} at {where.name}:{frame.f_lineno}")
        return func(*args, **kwargs)


@pytest.mark.parametrize("strategy", ["ddp", "fsdp2", "zero2"])
def test_a_step_reads_the_device_once_and_builds_nothing_from_host_data(strategy, fm_tree, tmp_path, monkeypatch):
    seen = []

    def watched_step(run, state, micro_batches):
        with StepCalls() as calls:
            result = train_step(run, state, micro_batches)
        seen.append(calls)
        return result

    train_step = loop.train_step
    monkeypatch.setattr(loop, "train_step", watched_step)
    r = tiny_recipe(tmp_path / "r.yaml", "imagefolder", fm_tree, tmp_path / "out",
                    data={"micro_batch_size": 16, "val_path": "", "augment_on": "device"},
                    parallel={"strategy": strategy}, schedule={"max_steps": 2})
    assert train_here(r) == 0
    assert len(seen) == 2 and len(records(tmp_path / "out")) == 2
    for calls in seen:
        assert calls.made == [], calls.made
        assert [r.split(" at ")[0] for r in calls.reads] == ["tolist"], calls.reads


def test_step_stats_are_named_slots_of_one_reduction():
    from convit_scale.train.step import StepStats, StepTotals

    stats = StepStats(torch.device("cpu"))
    stats.add("loss_sum", torch.tensor(2.5))
    stats.add("loss_sum", 0.5)
    stats.add("stop", 1.0)
    totals = stats.reduce()  # no process group: the identity
    assert isinstance(totals, StepTotals) and totals.loss_sum == 3.0 and totals.stop == 1.0
    assert totals.bad_loss == totals.grad_sq == totals.bad_samples == totals.save_failed == 0.0
    from convit_scale.planner import STEP_REDUCTION_BYTES

    assert STEP_REDUCTION_BYTES == stats.vector.numel() * stats.vector.element_size()  # what the planner counts


def test_the_next_steps_first_micro_batch_is_made_on_the_device_before_the_steps_read(fm_wds, tmp_path,
                                                                                      monkeypatch):
    """decode_on device: each step's first micro-batch after the first is taken from the loader, decoded, resized
    and augmented while the step before it waits for its reduction (between the all-reduce's start and its read),
    once, never past the run's last step; the run's numbers are those of a run that makes each micro-batch in its
    turn."""
    from convit_scale.data import device_images
    from convit_scale.train import step as step_module

    def run(name, events):
        real_make, real_read = device_images.batch_on_device, step_module.StepStats.read
        real_augment = step_module.augment_batch
        monkeypatch.setattr(device_images, "batch_on_device",
                            lambda batch, *a: events.append(("made", tuple(batch.ids))) or real_make(batch, *a))
        monkeypatch.setattr(step_module, "augment_batch",
                            lambda x, seeds, cfg: events.append(("augmented",)) or real_augment(x, seeds, cfg))
        monkeypatch.setattr(step_module.StepStats, "read",
                            staticmethod(lambda reduced: events.append(("read",)) or real_read(reduced)))
        r = tiny_recipe(tmp_path / f"{name}.yaml", "wds", fm_wds, tmp_path / name, schedule={"max_steps": 3},
                        data={"decode_on": "device", "augment_on": "device", "val_path": "", "micro_batch_size": 16},
                        parallel={"strategy": "none"}, checkpoint={"every_steps": 100})
        assert train_here(r) == 0
        monkeypatch.undo()
        return records(tmp_path / name)

    events = []
    ahead = run("ahead", events)
    kinds = [e[0][0] for e in events]  # (m)ade, (a)ugmented, (r)ead; 2 micro-batches a step, one read each
    assert "".join(kinds) == "mamamar" "mamar" "mar", kinds
    assert len({e[1] for e in events if e[0] == "made"}) == 6  # each micro-batch once
    monkeypatch.setattr(step_module.StepMicroBatches, "following", lambda self: None)
    in_turn = run("in_turn", [])
    assert [r["loss"] for r in ahead] == [r["loss"] for r in in_turn] and len(ahead) == 3


def test_an_error_met_while_taking_or_making_a_micro_batch_early_is_raised_in_its_turn(monkeypatch):
    """The loader's refusal, or the device's failure, met while the next step's micro-batch was made early, ends the
    run where it did before: when that step asks for it, after the step before it finished (its update, its saves);
    the device running out of memory then (the step's gradients still held) has the batch made again in its turn."""
    from convit_scale.data import DataError, device_images
    from convit_scale.data.batch import Batch
    from convit_scale.data.device_images import StepImages
    from convit_scale.train.step import _Ahead

    def loader():
        yield 1
        raise DataError("too many unreadable samples")

    ahead = _Ahead(loader())
    assert ahead.peek() == 1 and next(ahead) == 1
    assert ahead.peek() is None  # the error is kept...
    with pytest.raises(DataError, match="too many"):
        next(ahead)  # ...and raised in its turn
    calls = []

    def out_of_memory_once(batch, *args):
        calls.append(batch)
        if len(calls) == 1:
            raise torch.OutOfMemoryError("CUDA out of memory")
        return batch.images, batch.labels

    monkeypatch.setattr(device_images, "batch_on_device", out_of_memory_once)
    images = StepImages(torch.device("cpu"), 8, 1)
    batch = Batch(torch.zeros(1, 3, 8, 8, dtype=torch.uint8), torch.zeros(1, dtype=torch.long))
    images.prepare(batch)  # the device's out-of-memory error, with the step's gradients still held: dropped...
    assert images(batch, repeated_next=False)[0] is batch.images and len(calls) == 2  # ...and made in its turn
    monkeypatch.setattr(device_images, "batch_on_device",
                        lambda *a: (_ for _ in ()).throw(RuntimeError("Failed to decode batch: CUDA ERROR")))
    images.prepare(batch)  # any other error: kept...
    with pytest.raises(RuntimeError, match="CUDA ERROR"):
        images(batch, repeated_next=False)  # ...and raised when the batch is asked for
