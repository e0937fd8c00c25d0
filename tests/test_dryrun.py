"""``plan --dry-run``: the recipe's own training step on simulated GPUs (convit_scale/dryrun), in this process.

Every strategy at 2 ranks, and the layouts whose shards depend on the world (FSDP2, HSDP's 2 x 2 mesh, ZeRO-3) at 4
on 2 nodes too, shows the step clean (no device mismatch, no CPU tensor in a collective, no
pageable copy after the warm-up, DDP and FSDP2 one host read per step, ZeRO the host read plus DeepSpeed's own waits,
``report.DEEPSPEED_WAITS``), and each kind of defect planted in the project's code is caught. A tiny ConViT at a
32-pixel input keeps each run to seconds; the ConViT-B+ runs at 32 ranks are BENCHMARKS.md's ("Simulated GPUs"),
not the suite's. The first run on a machine builds the driverless CUDA extension (about a minute, cached)."""

from __future__ import annotations

import json
import os

import pytest
import torch

from convit_scale import comm
from convit_scale.config import load_config
from convit_scale.data.batch import Batch
from convit_scale.dryrun.native import simulation_problem

pytestmark = pytest.mark.skipif(simulation_problem() is not None, reason=f"no simulated GPUs: {simulation_problem()}")

STEPS = 3  # two warm-up steps (report.WARMUP_STEPS) and one counted
LAYOUTS = {
    "ddp": ["parallel.strategy=ddp"],
    "fsdp2": ["parallel.strategy=fsdp2", "parallel.reshard_after_forward=true"],
    "fsdp2 kept": ["parallel.strategy=fsdp2", "parallel.reshard_after_forward=false"],
    "hsdp": ["parallel.strategy=fsdp2", "parallel.hsdp_replicas=2"],
    "zero1": ["parallel.strategy=zero1"],
    "zero2": ["parallel.strategy=zero2"],
    "zero3": ["parallel.strategy=zero3"],
}
STEP_READ = ("convit_scale/train/step.py", "a host read")
"""The step's one read: its packed reduction (``StepStats.reduce``)."""


def tiny(tmp_path, *overrides):
    from tests.support import tiny_recipe

    path = tiny_recipe(tmp_path / "tiny.yaml", "imagefolder", tmp_path / "data", tmp_path / "run",
                       model={"name": "convit_nano", "num_classes": 10, "drop_path_rate": 0.1, "img_size": 32},
                       data={"format": "imagefolder", "train_path": "x", "val_path": "x", "global_batch_size": 16,
                             "eval_batch_size": 8, "num_workers": 0, "repeated_aug": 1, "mixup": 0.8, "cutmix": 1.0,
                             "rand_augment": "rand-m9-mstd0.5-inc1", "reprob": 0.25},
                       parallel={"strategy": "fsdp2", "precision": "bf16"})
    return load_config(path, list(overrides))


def dry(tmp_path, nodes, gpus, *overrides, steps=STEPS):
    from convit_scale.dryrun.report import census_summary
    from convit_scale.dryrun.run import dry_run

    result = dry_run(tiny(tmp_path, *overrides), nodes, gpus, steps=steps)
    return result, census_summary(result["census"], steps)


def _waits(summary) -> list[tuple[str, str, float]]:
    return sorted((r["what"], r["origin"], r["count"]) for r in summary["host wait"]["each"])


AT_FOUR = ("fsdp2", "hsdp", "zero3")
"""The layouts also run at 4 ranks on 2 nodes: those whose shards (and HSDP's mesh) change with the world; DDP's,
ZeRO-1/2's and the kept FSDP2's step is the same code at any world size."""


@pytest.mark.parametrize("layout, world", [(layout, (1, 2)) for layout in LAYOUTS]
                         + [(layout, (2, 2)) for layout in AT_FOUR],
                         ids=[f"{layout}-world2" for layout in LAYOUTS] + [f"{layout}-world4" for layout in AT_FOUR])
def test_every_strategy_steps_clean_on_simulated_gpus(tmp_path, layout, world):
    from convit_scale.dryrun.report import DEEPSPEED_WAITS

    result, summary = dry(tmp_path, *world, *LAYOUTS[layout])
    assert result["mismatch"] is None
    assert result["peak_bytes"] > 0
    assert summary["cpu collective"]["per_step"] == 0 and not summary["cpu collective"]["once"]
    assert summary["pageable copy"]["per_step"] == 0
    step_reads = [r for r in summary["host wait"]["each"]
                  if r["frame"].startswith(STEP_READ[0]) and r["what"].startswith(STEP_READ[1])]
    assert [r["count"] for r in step_reads] == [1.0], summary["host wait"]
    own = sorted((r["what"], r["origin"], r["count"]) for r in summary["host wait"]["each"] if r not in step_reads)
    strategy = LAYOUTS[layout][0].split("=")[1]
    assert own == sorted(DEEPSPEED_WAITS.get(strategy, [])), own


def test_the_device_decode_and_micro_batches_step_clean_on_simulated_gpus(tmp_path):
    """``decode_on: device`` (the Ti recipes) with two micro-batches a step (``data.micro_batch_size``, which plan
    advises where a batch does not fit; MemTracker stopped the dry run at the second forward): the views handed over
    undecoded run the device's decode path (loaders' images standing in for nvJPEG's), no pageable copy, and one host
    wait per micro-batch beside the step's read: the decode stream's previous batch, which on a GPU has finished by
    then (the step's read waited for it)."""
    result, summary = dry(tmp_path, 1, 2, "parallel.strategy=fsdp2", "data.format=wds", "data.decode_on=device",
                          "data.micro_batch_size=4")
    assert result["mismatch"] is None and result["peak_bytes"] > 0
    assert summary["pageable copy"]["per_step"] == 0 and summary["cpu collective"]["per_step"] == 0
    waits = sorted((r["what"], r["frame"].split(":")[0], r["count"]) for r in summary["host wait"]["each"])
    assert waits == [(STEP_READ[1] + " of a device value (.item(), bool(), .tolist(), float())", STEP_READ[0], 1.0),
                     ("torch.cuda.Stream.synchronize", "convit_scale/data/device_images.py", 2.0)], waits


def test_a_cpu_tensor_added_to_a_device_activation_is_a_device_mismatch(tmp_path, monkeypatch):
    from convit_scale.models import convit

    forward = convit.Block.forward

    def planted(self, x, keep=None):
        return forward(self, x, keep) + torch.zeros(x.shape[-1])  # a host tensor: a GPU run stops here

    monkeypatch.setattr(convit.Block, "forward", planted)
    result, _ = dry(tmp_path, 1, 2)
    assert result["mismatch"] is not None and "tests/test_dryrun.py" not in result["mismatch"]
    assert "convit_scale/models/convit.py" in result["mismatch"] or "convit_scale/" in result["mismatch"]


def test_a_cpu_tensor_handed_to_a_collective_is_counted(tmp_path, monkeypatch):
    monkeypatch.setattr(comm, "set_device", lambda device: None)  # the communication device left on the host
    monkeypatch.setattr(comm, "_device", torch.device("cpu"))
    result, summary = dry(tmp_path, 1, 2)
    rows = summary["cpu collective"]["each"]
    assert rows and rows[0]["what"] == "c10d.allreduce_" and rows[0]["frame"].startswith("convit_scale/comm.py")
    assert result["mismatch"] is None


def test_a_pageable_copy_is_counted_with_its_frame(tmp_path, monkeypatch):
    monkeypatch.setattr(Batch, "pin_memory", lambda self: self)  # a loader that forgot to pin its batches
    _, summary = dry(tmp_path, 1, 2)
    frames = {r["frame"].split(":")[0] for r in summary["pageable copy"]["each"]}
    assert "convit_scale/data/device_images.py" in frames and summary["pageable copy"]["per_step"] >= 2


def test_a_step_joined_into_page_locked_memory_copies_nothing_pageable():
    """A step's images joined from its parts straight into page-locked memory (``cat_images(..., pin=True)``: one
    copy, not a cat then a pin) reach the device without a pageable copy; joined into pageable memory they are
    counted."""
    from convit_scale.data.batch import Boxes, cat_images
    from convit_scale.dryrun.census import Census
    from convit_scale.dryrun.device import simulated_gpus

    parts = [torch.zeros(2, 3, 4, 4, dtype=torch.uint8), torch.ones(1, 3, 4, 4, dtype=torch.uint8)]
    boxes = [Boxes(torch.zeros(12, dtype=torch.uint8), torch.tensor([[2, 2]]), torch.tensor([True]))] * 2
    counted = []
    for pin in (True, False):
        census = Census()
        with simulated_gpus(2, 2, census):
            images, joined = cat_images(parts, pin), cat_images(boxes, pin)
            assert torch.equal(images, torch.cat(parts)) and joined.sizes.tolist() == [[2, 2]] * 2
            images.to("cuda", non_blocking=True), joined.pixels.to("cuda", non_blocking=True)
        counted.append(sum(e.kind == "pageable copy" for e in census.events))
    assert counted == [0, 2]


def test_an_extra_host_read_per_step_is_counted_with_its_frame(tmp_path, monkeypatch):
    from convit_scale.train import step

    add = step.StepStats.add

    def planted(self, name, value):
        if name == "loss_sum":
            float(value)  # a host read of the loss: the step waits for the device
        return add(self, name, value)

    monkeypatch.setattr(step.StepStats, "add", planted)
    _, summary = dry(tmp_path, 1, 2, "parallel.strategy=ddp")
    assert summary["host wait"]["per_step"] == 2
    assert {r["frame"].split(":")[0] for r in summary["host wait"]["each"]} == {"convit_scale/train/step.py"}


def test_plan_dry_run_prints_and_answers_json(tmp_path, capsys):
    from convit_scale.cli import main

    tiny(tmp_path)
    recipe = str(tmp_path / "tiny.yaml")
    before = (torch.cuda.is_available, torch.cuda.synchronize, torch.cuda.current_stream, torch.cuda.set_device)
    args = ["plan", "--recipe", recipe, "--dry-run", "--nodes", "1", "--gpus-per-node", "2", "--steps", "3",
            "model.img_size=32"]
    assert main(args + ["--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["world_size"] == 2 and out["host_waits"]["per_step"] == 1 and out["model_gib"] > 0
    assert out["trusted"] in ("agree", "measured") and out["measured_steps"] == [3]
    # torch.cuda answers as a GPU only for the dry run's duration
    assert (torch.cuda.is_available, torch.cuda.synchronize, torch.cuda.current_stream, torch.cuda.set_device) == before
    assert not torch.cuda.is_available() and not torch.distributed.is_initialized()
    assert main(["plan", "--recipe", recipe, "--json"]) == 2  # a flag of --dry-run alone: refused, not ignored
    assert "--dry-run" in capsys.readouterr().err


def test_a_process_that_ran_a_backward_on_the_cpu_first_can_dry_run(tmp_path):
    """The autograd engine sizes its per-device threads at a process's first backward: a dry run after a CPU backward
    (a notebook, a test worker) found none for cuda. Run where the engine started before the driverless CUDA.
    DeepSpeed keeps the accelerator its import finds: imported first by the dry run, it must find the machine's
    (here the CPU), not the simulated GPUs, or a ZeRO engine built after the dry run asks the driver for a device."""
    from tests.support import PY, run_group

    tiny(tmp_path)
    code = ("import torch, sys; x = torch.ones(2, requires_grad=True); (x * 2).sum().backward()\n"
            "from convit_scale.cli import main\n"
            "assert 'deepspeed' not in sys.modules\n"
            f"code = main(['plan', '--recipe', {str(tmp_path / 'tiny.yaml')!r}, '--dry-run', '--nodes', '1', "
            "'--gpus-per-node', '2', '--steps', '3', '--json', 'parallel.strategy=ddp'])\n"
            "assert torch.autograd.is_multithreading_enabled()  # put back after the dry run\n"
            "from deepspeed.accelerator import get_accelerator\n"
            "assert get_accelerator().device_name() == 'cpu', get_accelerator()\n"
            "sys.exit(code)")
    proc = run_group([PY, "-c", code], 300, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert json.loads(proc.stdout)["host_waits"]["per_step"] == 1


def test_a_torch_that_cannot_simulate_is_one_line(tmp_path, capsys, monkeypatch):
    from convit_scale.cli import main
    from convit_scale.dryrun import native

    monkeypatch.setattr(native, "NEEDS", (("torch._subclasses.fake_tensor", "NoSuchThing"),))
    tiny(tmp_path)
    assert main(["plan", "--recipe", str(tmp_path / "tiny.yaml"), "--dry-run", "--nodes", "1",
                 "--gpus-per-node", "2"]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "cannot simulate GPUs here" in err[0] and "NoSuchThing" in err[0]


def test_the_device_decode_on_cuda_decodes_on_its_stream_and_resizes_on_the_training_stream(monkeypatch):
    """``decode_on: device`` on (simulated) CUDA: the views' crops made on the decode's own stream, then resized on
    the training stream, which waits for them and holds their blocks (``record_stream``) until it has read them;
    one host wait per batch (the decode stream's previous batch), no pageable copy. Loader-decoded views stand in
    for JPEGs (nvJPEG needs a GPU: ``make gpu-test``)."""
    import numpy as np

    from convit_scale.data import device_images
    from convit_scale.data.batch import Encoded
    from convit_scale.dryrun.census import Census
    from convit_scale.dryrun.device import simulated_gpus

    recorded, record_stream = [], torch.Tensor.record_stream
    views = Encoded.of([(np.full((20, 16, 3), k, np.uint8), Encoded.RAW, (20, 16), (k, 0, 20 - k, 16), k % 2 == 0)
                        for k in range(3)])
    census = Census()
    with simulated_gpus(2, 2, census):
        monkeypatch.setattr(torch.Tensor, "record_stream",
                            lambda t, s: (recorded.append((t.device.type, s)), record_stream(t, s))[1])
        images, failed = device_images.decode_views(views.pin_memory(), torch.device("cuda", 0), 8)
        monkeypatch.setattr(torch.Tensor, "record_stream", record_stream)
        assert images.device.type == "cuda" and tuple(images.shape) == (3, 3, 8, 8) and failed == {}
        training = torch.cuda.current_stream(0)
    assert len(recorded) == 3 and all(kind == "cuda" and s == training for kind, s in recorded)
    assert [e.kind for e in census.events].count("pageable copy") == 0
    assert [e.kind for e in census.events].count("host wait") == 1, [(e.kind, e.what) for e in census.events]
