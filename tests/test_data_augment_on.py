"""``data.augment_on``: the loaders stop at uint8 crops with the CPU path's seeds, the engine augments them on the
training device (here the CPU process), seeded, resumable; recipes the device cannot run are refused."""

import itertools

import numpy as np
import pytest
import torch
from support import losses, tiny_recipe, train_here

from convit_scale.config import ConfigError, DataConfig, load_config
from convit_scale.data import LoaderSpec, build_loader
from convit_scale.data.device_augment import augment_on_device, normalize
from convit_scale.data.order import view_seeds

CROP_ONLY = {"repeated_aug": 1, "rand_augment": None, "color_jitter": 0.0, "reprob": 0.0}


def _same(a, b) -> bool:
    return torch.equal(a.images, b.images) and torch.equal(a.labels, b.labels) and torch.equal(a.seeds, b.seeds)


@pytest.mark.parametrize("fmt", ["imagefolder", "wds", "ffcv"])
def test_device_mode_batches_are_uint8_crops_with_the_cpu_paths_seeds(fmt, fm_tree, fm_wds, fm_ffcv):
    path = {"imagefolder": fm_tree, "wds": fm_wds, "ffcv": fm_ffcv}[fmt]
    d = DataConfig(format=fmt, train_path=str(path), val_path=str(path), num_workers=0, **CROP_ONLY)
    loader = build_loader(d, LoaderSpec("train", 32, 16, seed=3, augment_on_device=True))
    first = list(itertools.islice(loader.epoch(1), 3))
    for b in first:
        assert b.images.dtype == torch.uint8 and b.images.shape == (16, 3, 32, 32)
        assert b.seeds.dtype == torch.int64 and b.seeds.shape == (16,)
    # the seeds the CPU path draws its augmentation from (one rank: global position = position in the epoch)
    want = view_seeds(3, 1, np.arange(16)).astype(np.int64).tolist()  # one seed function for every format
    assert first[0].seeds.tolist() == want
    again = list(itertools.islice(loader.epoch(1), 3))
    assert all(_same(a, b) for a, b in zip(first, again))  # the same seed: the same batches
    assert _same(next(iter(loader.epoch(1, start_batch=2))), first[2])  # a resume continues the epoch
    # the CPU path with no augmentation after the crop: the same crops, normalised there
    cpu = next(iter(build_loader(d, LoaderSpec("train", 32, 16, seed=3)).epoch(1)))
    assert torch.equal(cpu.seeds, first[0].seeds) and torch.allclose(normalize(first[0].images), cpu.images, atol=1e-6)
    val = next(iter(build_loader(d, LoaderSpec("val", 32, 16, augment_on_device=True)).epoch(0)))
    cpu_val = next(iter(build_loader(d, LoaderSpec("val", 32, 16)).epoch(0)))
    assert val.images.dtype == torch.uint8 and val.images.shape == (16, 3, 32, 32)
    assert torch.allclose(normalize(val.images), cpu_val.images, atol=1e-6)


def test_augment_on_resolves_from_the_device_and_the_recipe():
    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    deit = DataConfig()
    assert augment_on_device(deit, cuda) and not augment_on_device(deit, cpu)
    assert augment_on_device(DataConfig(augment_on="device"), cpu)
    assert not augment_on_device(DataConfig(augment_on="cpu"), cuda)
    # auto keeps what the device cannot run on the CPU
    assert not augment_on_device(DataConfig(rand_augment="rand-m9-w0"), cuda)
    assert not augment_on_device(DataConfig(rand_augment=None, color_jitter=0.4), cuda)


@pytest.mark.parametrize("overrides, needle", [
    (["data.rand_augment=rand-m9-w0"], "data.rand_augment = 'rand-m9-w0' does not run on the device"),
    (["data.rand_augment=null"], "colour jitter (data.color_jitter = 0.4"),
    (["data.interpolation=bilinear"], "run bicubic on the device"),
])
def test_device_mode_refuses_what_the_device_cannot_run(overrides, needle):
    with pytest.raises(ConfigError, match=r"data\.augment_on = 'device' is not allowed; ") as e:
        load_config(None, ["data.augment_on=device", *overrides])
    assert needle in str(e.value) and "\n" not in str(e.value)
    for mode in ("auto", "cpu"):  # the CPU runs all of them
        load_config(None, [f"data.augment_on={mode}", *overrides])


@pytest.mark.slow
def test_device_mode_training_is_seeded_and_resumes_bit_identically(fm_tree, tmp_path, capsys):
    """One process (this one), augmentation in the training process: an uninterrupted run of 4 steps against one
    stopped at step 2 (its checkpoint) and resumed; both start with the same losses (same seed), and the device
    path is not the CPU path (other random draws, other losses)."""
    kw = dict(data={"augment_on": "device", "num_workers": 1, "repeated_aug": 1},
              parallel={"strategy": "none", "precision": "fp32"}, checkpoint={"every_steps": 2})
    full = tiny_recipe(tmp_path / "a.yaml", "imagefolder", fm_tree, tmp_path / "a", schedule={"max_steps": 4}, **kw)
    assert train_here(full) == 0
    part = tiny_recipe(tmp_path / "b.yaml", "imagefolder", fm_tree, tmp_path / "b", schedule={"max_steps": 2}, **kw)
    assert train_here(part) == 0
    capsys.readouterr()
    assert train_here(part, "schedule.max_steps=4") == 0
    printed = capsys.readouterr().out
    assert "resumed from" in printed and "step_000000002" in printed
    assert len(losses(tmp_path / "a")) == 4 and losses(tmp_path / "b") == losses(tmp_path / "a")
    assert train_here(part, f"run.output_dir={tmp_path / 'c'}", "data.augment_on=cpu") == 0
    assert losses(tmp_path / "c")[0] != losses(tmp_path / "a")[0]
