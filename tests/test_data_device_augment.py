"""Device augmentation against timm's PIL RandAugment and RandomErasing: op by op, in distribution, reproducibly."""

import contextlib
import math
import random

import numpy as np
import pytest
import torch
from PIL import Image
from timm.data.auto_augment import LEVEL_TO_ARG, NAME_TO_OP, rand_augment_transform
from timm.data.random_erasing import RandomErasing
from torch.overrides import TorchFunctionMode

from convit_scale.augment_policy import ALL_OPS, GEOMETRIC_OPS, RAND_INCREASING_OPS, RAND_OPS, RandAugmentPolicy
from convit_scale.data.device_augment import (
    DeviceAugmentConfig,
    apply_op,
    augment_batch,
    normalize,
    sample_plan,
    uniforms,
)
from convit_scale.errors import BadInput

DEIT_HPARAMS = dict(translate_const=int(224 * 0.45), img_mean=(124, 116, 104), interpolation=Image.BICUBIC)
POLICY = "rand-m9-mstd0.5-inc1"
DISCRETE_OPS = {"PosterizeIncreasing", "SolarizeIncreasing", "SolarizeAdd"}
ENHANCE_OPS = {"ColorIncreasing", "ContrastIncreasing", "BrightnessIncreasing", "SharpnessIncreasing"}


@pytest.fixture(scope="module")
def photos(request) -> list[Image.Image]:
    """Four real 80x96 (HxW) RGB crops: matplotlib's sample photo, else Fashion-MNIST images resized."""
    try:
        import matplotlib.cbook

        img = Image.open(matplotlib.cbook.get_sample_data("grace_hopper.jpg")).convert("RGB")
        return [img.crop((x, y, x + 96, y + 80)) for x, y in ((0, 0), (200, 150), (300, 400), (100, 500))]
    except (ImportError, OSError):
        files = sorted(request.getfixturevalue("fm_tree").glob("train/*/*"))[:4]
        return [Image.open(f).convert("RGB").resize((96, 80), Image.BICUBIC) for f in files]


def _batch(images) -> torch.Tensor:
    return torch.from_numpy(np.stack([np.asarray(i) for i in images])).permute(0, 3, 1, 2).contiguous()


@pytest.mark.parametrize("name", sorted(set(RAND_INCREASING_OPS) | set(RAND_OPS)))
def test_op_matches_timm_pil(name, photos):
    # Same level argument (timm's level_fn, its sign drawn by Python's random) on the same photos, both ways.
    # Colour ops mirror PIL's integer/float32 arithmetic: mean |diff| <= 0.01, no pixel off by more than 1.
    # Geometric ops resample (PIL's a=-1 bicubic, float64 coordinates): mean |diff| <= 0.05 grey levels and at
    # most 0.1% of pixels off by more than 1 (a float rounding can move a source point across the border).
    x = _batch(photos).float()
    for magnitude in (3.0, 9.0, 10.0):
        for seed in (0, 1, 2):
            random.seed(seed)
            args = LEVEL_TO_ARG[name](magnitude, DEIT_HPARAMS) if LEVEL_TO_ARG[name] else ()
            try:
                ref = [NAME_TO_OP[name](p, *args, fillcolor=DEIT_HPARAMS["img_mean"], resample=Image.BICUBIC)
                       for p in photos]
            except ValueError:  # Pillow >= 13 refuses posterize(0 bits); Pillow < 13 returns black, as we do
                assert name.startswith("Posterize") and args == (0,)
                continue
            arg = torch.full((len(photos),), float(args[0]) if args else 0.0, dtype=torch.float64)
            diff = (apply_op(name, x.clone(), arg) - _batch(ref).float()).abs()
            where = f"{name} m={magnitude} args={args}"
            if name in GEOMETRIC_OPS:
                assert diff.mean() <= 0.05, where
                assert (diff > 1).float().mean() <= 1e-3, where
            else:
                assert diff.mean() <= 0.01, where
                assert diff.max() <= 1, where


def _timm_draws(n_images: int) -> list[list[tuple[str, tuple]]]:
    """The (op, level args) timm's RandAugment applies to each of n images: each op's image function is
    swapped for a recorder, so timm's own choice, prob, magnitude-noise and sign code runs unchanged."""
    ra = rand_augment_transform(POLICY, dict(DEIT_HPARAMS))
    log: list = []
    for op in ra.ops:
        op.aug_fn = lambda img, *args, _name=op.name, **_: (log[-1].append((_name, args)), img)[1]
    random.seed(0)
    np.random.seed(0)
    tiny = Image.new("RGB", (4, 4))
    for _ in range(n_images):
        log.append([])
        ra(tiny)
    return log


def _close(a, b, what):
    # means agree within 4 standard errors of their difference (a fixed-seed check, not a flaky one)
    a, b = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
    tol = 4 * math.sqrt(a.var() / len(a) + b.var() / len(b)) + 1e-9
    assert abs(a.mean() - b.mean()) <= tol, f"{what}: {a.mean():.4f} vs timm {b.mean():.4f} (tol {tol:.4f})"


def test_op_choices_and_magnitudes_match_timm():
    n = 8000
    timm_log = _timm_draws(n)
    cfg = DeviceAugmentConfig(rand_augment=POLICY, reprob=0.0)
    plan = sample_plan(torch.arange(n, dtype=torch.int64), cfg, 224, 224)
    ops = cfg.policy.ops
    ours = [[(ops[k], a) for k, a in zip(plan.op[:, i].tolist(), plan.arg[:, i].tolist()) if k >= 0]
            for i in range(n)]

    # ops applied per image: 0, 1 or 2 with probabilities 1/4, 1/2, 1/4
    _close([len(o) for o in ours], [len(t) for t in timm_log], "ops applied per image")
    for name in ops:
        per_image_ours = [sum(op == name for op, _ in o) for o in ours]
        per_image_timm = [sum(op == name for op, _ in t) for t in timm_log]
        assert abs(np.mean(per_image_ours) - 1 / 15) < 0.015, name  # 2 layers x p 0.5 / 15 ops
        _close(per_image_ours, per_image_timm, f"{name} frequency")
        theirs = [args[0] for t in timm_log for op, args in t if op == name and args]
        if not theirs:
            continue
        mine = [a for o in ours for op, a in o if op == name]
        _close(mine, theirs, f"{name} argument")
        neutral = 1.0 if name in ENHANCE_OPS else 0.0  # enhance factors leave the image unchanged at 1
        _close(np.abs(np.subtract(mine, neutral)), np.abs(np.subtract(theirs, neutral)), f"{name} |arg - neutral|")
        if name not in DISCRETE_OPS:  # (a discrete arg's rare values are covered by the mean's SE test)
            assert np.std(mine) == pytest.approx(np.std(theirs), rel=0.15), f"{name} argument std"

    # the magnitude itself: gauss(9, 0.5) clipped to [0, 10]
    applied = plan.op >= 0
    mags = plan.magnitude[applied].numpy()
    assert mags.mean() == pytest.approx(9.0, abs=0.03) and mags.std() == pytest.approx(0.49, abs=0.03)
    assert mags.max() == 10.0 and (mags == 10.0).mean() == pytest.approx(0.023, abs=0.01)


def test_policy_parsing_matches_timm_and_refuses_the_rest():
    policy = RandAugmentPolicy.parse(POLICY)
    timm_ra = rand_augment_transform(POLICY, dict(DEIT_HPARAMS))
    assert list(policy.ops) == [op.name for op in timm_ra.ops]
    assert (policy.num_layers, policy.magnitude, policy.prob) == (timm_ra.num_layers, 9.0, 0.5)
    assert policy.magnitude_std == timm_ra.ops[0].magnitude_std == 0.5
    plain = RandAugmentPolicy.parse("rand-m7-n3-p0.8-mstd101-mmax12")
    assert plain.ops == RAND_OPS and plain.num_layers == 3 and plain.prob == 0.8
    assert plain.magnitude_std == math.inf and plain.magnitude_max == 12.0
    for bad in ("augmix-m5", "original-mstd0.5", "rand-m9-tweights", "rand-x3", "rand-m9-inc", "rand-p0.5.5"):
        with pytest.raises(BadInput, match="supported") as err:
            RandAugmentPolicy.parse(bad)
        assert bad in str(err.value) and "\n" not in str(err.value)
    with pytest.raises(ValueError, match="reprob"):
        DeviceAugmentConfig(reprob=1.5)


def test_same_seed_same_output_whatever_the_batch(photos):
    x = _batch(photos * 4)  # 16 images, 80x96
    seeds = torch.arange(16, dtype=torch.int64) * 1_000_003 + 7
    out = augment_batch(x, seeds)
    assert out.dtype == torch.float32 and out.shape == x.shape
    assert torch.equal(out, augment_batch(x, seeds))
    order = torch.randperm(16, generator=torch.Generator().manual_seed(0))
    assert torch.equal(augment_batch(x[order], seeds[order]), out[order])
    assert torch.equal(augment_batch(x[3:5], seeds[3:5]), out[3:5])
    assert not torch.equal(augment_batch(x, seeds + 1), out)
    # the same photo under 4 different seeds comes out 4 different ways
    assert len({out[i].sum().item() for i in (0, 4, 8, 12)}) == 4


def test_hash_is_splitmix64():
    # the int64 torch ops (wrapping multiply, masked shifts) give the same bits as the textbook algorithm
    mask = (1 << 64) - 1

    def splitmix(state):
        state = (state + 0x9E3779B97F4A7C15) & mask
        z = state
        z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & mask
        z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & mask
        return state, z ^ (z >> 31)

    seeds = [0, 1, 12345, 2**62 + 3, -5]
    u = uniforms(torch.tensor(seeds, dtype=torch.int64), 4)
    for row, seed in enumerate(seeds):
        _, key = splitmix(seed & mask)  # the sample's key is splitmix64's first output for its seed
        state = key
        for k in range(4):
            state, z = splitmix(state)
            assert u[row, k].item() == (z >> 11) * 2.0 ** -53


def test_normalisation_is_totensor_normalize():
    from torchvision.transforms import functional as F

    x = torch.randint(0, 256, (3, 3, 20, 24), dtype=torch.uint8, generator=torch.Generator().manual_seed(0))
    ref = torch.stack([F.normalize(F.to_tensor(F.to_pil_image(img)), DeviceAugmentConfig().mean,
                                   DeviceAugmentConfig().std) for img in x])
    assert torch.equal(normalize(x), ref)
    plain = DeviceAugmentConfig(rand_augment=None, reprob=0.0)
    assert torch.equal(augment_batch(x, torch.arange(3), plain), ref)
    with pytest.raises(ValueError, match=r"uint8 tensor \(B, 3, H, W\); got dtype=torch.float32"):
        augment_batch(x.float(), torch.arange(3))
    with pytest.raises(ValueError, match=r"seeds must be an int64 tensor of shape \(3,\)"):
        augment_batch(x, torch.arange(4))


def _timm_boxes(n: int, h: int, w: int):
    erase = RandomErasing(probability=0.25, mode="pixel", max_count=1, device="cpu")
    random.seed(0)
    torch.manual_seed(0)
    boxes = []
    for _ in range(n):
        img = torch.zeros(3, h, w)
        erase(img)
        rows, cols = img.abs().sum(0).nonzero(as_tuple=True)
        boxes.append((0, 0, 0, 0) if rows.numel() == 0 else
                     (rows.min().item(), cols.min().item(), rows.max().item() - rows.min().item() + 1,
                      cols.max().item() - cols.min().item() + 1))
    return np.array(boxes, dtype=np.float64)


def test_random_erasing_rate_and_boxes_match_timm():
    h, w, n = 48, 64, 4000
    theirs = _timm_boxes(n, h, w)
    cfg = DeviceAugmentConfig(rand_augment=None, reprob=0.25)
    ours = sample_plan(torch.arange(n, dtype=torch.int64), cfg, h, w).erase_box.double().numpy()
    _close(ours[:, 2] > 0, theirs[:, 2] > 0, "erase rate")
    assert (ours[:, 2] > 0).mean() == pytest.approx(0.25, abs=0.03)
    mine, timm_ = ours[ours[:, 2] > 0], theirs[theirs[:, 2] > 0]
    _close(mine[:, 2] * mine[:, 3] / (h * w), timm_[:, 2] * timm_[:, 3] / (h * w), "box area fraction")
    _close(np.log(mine[:, 2] / mine[:, 3]), np.log(timm_[:, 2] / timm_[:, 3]), "box log aspect")
    _close(mine[:, 0] / h, timm_[:, 0] / h, "box top")
    _close(mine[:, 1] / w, timm_[:, 1] / w, "box left")
    assert ((mine[:, 0] + mine[:, 2] <= h) & (mine[:, 1] + mine[:, 3] <= w)).all()

    # in the image: standard normal noise inside the box, the normalised image everywhere else
    x = torch.randint(0, 256, (64, 3, h, w), dtype=torch.uint8, generator=torch.Generator().manual_seed(1))
    seeds = torch.arange(64, dtype=torch.int64)
    out, clean = augment_batch(x, seeds, cfg), normalize(x)
    box = sample_plan(seeds, cfg, h, w).erase_box
    inside = torch.zeros(64, 1, h, w, dtype=torch.bool)
    for i, (top, left, bh, bw) in enumerate(box.tolist()):
        inside[i, :, top:top + bh, left:left + bw] = True
    inside = inside.expand_as(out)
    assert inside.any() and torch.equal(out[~inside], clean[~inside])
    noise = out[inside]
    assert abs(noise.mean().item()) < 0.02 and noise.std().item() == pytest.approx(1.0, abs=0.02)


def test_throughput_times_the_steps_after_the_warm_up(monkeypatch):
    """`bench data`'s device-stage rate (bench/data.py ``device_augment_rate``): ``warmup`` untimed calls, then
    ``steps`` timed ones, each of ``augment_batch`` on the whole uint8 batch with seeds no other call repeats (the
    same seeds would time the same plan again); images/s = batch x steps / the timed seconds."""
    import types

    from convit_scale.bench import data as bench

    calls = []

    def recorded(x, seeds, cfg=None):
        out = augment_batch(x, seeds, cfg)
        calls.append((x.dtype, tuple(x.shape), seeds.tolist(), out.dtype, tuple(out.shape)))
        return out

    clock = iter([10.0, 12.5])  # the start and the end of the timed steps
    monkeypatch.setattr(bench, "augment_batch", recorded)
    monkeypatch.setattr(bench, "time", types.SimpleNamespace(perf_counter=lambda: next(clock)))
    rate = bench.device_augment_rate("cpu", batch=4, img_size=32, steps=3, warmup=2)
    assert rate == pytest.approx(4 * 3 / 2.5)
    assert len(calls) == 5 and {c[:2] for c in calls} == {(torch.uint8, (4, 3, 32, 32))}
    assert {c[3:] for c in calls} == {(torch.float32, (4, 3, 32, 32))}
    seeds = [s for c in calls for s in c[2]]
    assert len(set(seeds)) == len(seeds) == 20


class HostToDevice(TorchFunctionMode):
    """Every way host data reaches a device tensor: a tensor made from host data on a device (torch.tensor,
    as_tensor: each a stream synchronisation on a GPU), and copies of CPU tensors to a device, with whether they
    were asynchronous."""

    def __init__(self):
        super().__init__()
        self.made, self.copies = [], []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        name = getattr(func, "__name__", "")
        on_device = isinstance(out, torch.Tensor) and out.device.type != "cpu"
        if name in ("tensor", "as_tensor", "asarray") and on_device:
            self.made.append(name)
        elif name in ("to", "cuda") and on_device and args[0].device.type == "cpu":
            self.copies.append(bool(kwargs.get("non_blocking", False)))
        elif name == "copy_" and args[0].device.type != "cpu" and args[1].device.type == "cpu":
            self.copies.append(bool(kwargs.get("non_blocking", False)))
        return out


def test_a_batch_reaches_the_device_in_one_asynchronous_transfer_per_dtype():
    # the meta device stands in for a GPU on the CPU: the per-batch arguments of RandAugment and erasing (op indices,
    # levels, affine coefficients, erasing boxes and seeds) must not be copied one by one, blocking, nor built on the
    # device from host data; constants (mean, std, fill colour) are made once per device
    x = torch.zeros((16, 3, 32, 32), dtype=torch.uint8, device="meta")
    seeds = torch.arange(16, dtype=torch.int64)
    cfg = DeviceAugmentConfig(reprob=1.0)
    augment_batch(x, seeds, cfg)  # the first batch makes the constants
    with HostToDevice() as seen:
        out = augment_batch(x, seeds + 16, cfg)
        normalize(x)
    assert out.device.type == "meta" and out.shape == (16, 3, 32, 32)
    assert seen.made == [] and 1 <= len(seen.copies) <= 2 and all(seen.copies)


OP_ARGS = [("SolarizeAdd", [0, 30, 60, 110]), ("Solarize", [16, 100, 200, 256]), ("Posterize", [1, 3, 5, 8]),
           ("Rotate", [-30, -5, 10, 30]), ("Translate", [-0.45, -0.1, 0.1, 0.45]), ("Shear", [-0.3, -0.1, 0.1, 0.3]),
           ("", [0.1, 0.7, 1.3, 1.9])]
"""Four arguments of each op (by the start of its name: the first that fits), one per photo; factors for the rest."""


def test_the_augmentation_divides_as_a_gpu_does(photos, monkeypatch):
    """CUDA divides by a number as a multiplication by its reciprocal (tests/cuda_arithmetic.py): every op of the
    policy, the erasing and the normalisation, run with the GPU's division (the plan drawn on the host with the
    CPU's, as in a GPU run), divide by no number whose reciprocal is inexact, so they give the CPU's pixels, bit for
    bit."""
    from cuda_arithmetic import CudaScalarDivision

    from convit_scale.data import device_augment

    gpu = CudaScalarDivision()
    on_the_host = device_augment.sample_plan

    def sample_plan(*args, **kwargs):
        with gpu.host():
            return on_the_host(*args, **kwargs)

    monkeypatch.setattr(device_augment, "sample_plan", sample_plan)

    x = _batch(photos * 8)  # 32 images: every op of the policy drawn for some
    seeds = torch.arange(32, dtype=torch.int64) * 7_919 + 11
    cfg = DeviceAugmentConfig(rand_augment="rand-m9-mstd0.5-inc1", reprob=0.25)
    def every_op():
        args = {name: next(a for start, a in OP_ARGS if name.startswith(start)) for name in ALL_OPS}
        return {name: apply_op(name, _batch(photos).float(), torch.tensor(args[name], dtype=torch.float64))
                for name in ALL_OPS}

    want = augment_batch(x, seeds, cfg), every_op()
    with gpu:
        got = augment_batch(x, seeds, cfg), every_op()
    assert gpu.inexact == []
    assert torch.equal(got[0], want[0]) and all(torch.equal(got[1][n], want[1][n]) for n in ALL_OPS)


def test_auto_contrast_and_contrast_are_pils_for_every_range_and_tie():
    """AutoContrast's table is PIL's for narrow ranges of levels too (255 / (hi - lo) divided, not 255 times the
    reciprocal), and Contrast's grey level is PIL's int(mean + 0.5) where the mean is a tie, with the GPU's division
    as with the CPU's."""
    from cuda_arithmetic import CudaScalarDivision
    from PIL import ImageEnhance, ImageOps

    ranges = [(lo, hi) for lo in range(0, 256, 5) for hi in range(lo, 256, 3)]
    photos = [np.linspace(lo, hi, 3 * 64).round().astype(np.uint8).reshape(8, 8, 3) for lo, hi in ranges]
    x = torch.from_numpy(np.stack(photos)).permute(0, 3, 1, 2).float()
    ref = np.stack([np.asarray(ImageOps.autocontrast(Image.fromarray(p))) for p in photos])
    zero = torch.zeros(len(photos), dtype=torch.float64)
    assert np.array_equal(apply_op("AutoContrast", x, zero).permute(0, 2, 3, 1).numpy(), ref)
    half = np.full((224, 224, 3), 1, np.uint8)  # luma mean 1.5 (sum 75264 over 224 x 224), and 7.5
    half[:112] = 2
    ties = [half, half + 6]
    x = torch.from_numpy(np.stack(ties)).permute(0, 3, 1, 2).float()
    factor = torch.full((2,), 0.5, dtype=torch.float64)
    ref = np.stack([np.asarray(ImageEnhance.Contrast(Image.fromarray(p)).enhance(0.5)) for p in ties])
    for mode in (contextlib.nullcontext(), CudaScalarDivision()):
        with mode:
            assert np.array_equal(apply_op("Contrast", x, factor).permute(0, 2, 3, 1).numpy(), ref)
