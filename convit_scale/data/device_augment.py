"""DeiT's training augmentation as batched tensor ops on the training device.

The loader's per-image PIL path (timm's RandAugment ``rand-m9-mstd0.5-inc1``, ToTensor/Normalize, random
erasing 0.25 in pixel mode) caps a rank at a few hundred images/s. Here the same augmentation runs on a whole
uint8 batch (B, 3, H, W) that the CPU has already decoded, RandomResizedCrop'ed and flipped:

    out = augment_batch(x_uint8, seeds)      # float32 (B, 3, H, W), normalised, RandAugment + erasing
    out = normalize(x_uint8)                 # eval: normalisation only

Every random choice of a sample (ops chosen, applied or not, magnitude noise, sign flips, erasing box and its
noise pixels) is a function of that sample's int64 seed only: draws come from a counter-based splitmix64 hash
of (seed, counter), never from torch's global RNG. Results are reproducible, independent of the rest of the
batch, and the same on CPU and GPU up to float error.

The arithmetic mirrors timm 1.0's ``auto_augment.py`` (op list, level -> argument rules, magnitude noise and
clipping, "increasing" variants, prob 0.5 per layer, sign flips) and the Pillow code those ops call: PIL's
blend (float32, truncation), RGB -> L luma in 16-bit fixed point, autocontrast/equalize look-up tables, the
SMOOTH 3x3 filter of Sharpness with its copied border, and PIL's affine BICUBIC sampler (a = -1 cubic, edge
clamped taps, pixel centres at +0.5, the fill colour outside the image). Geometric ops use bicubic sampling,
as DeiT's hparams set (``interpolation='bicubic'``); timm's 'random' interpolation is not mirrored.

Where randomness is drawn: the per-sample plan (op choices, magnitudes, box) is hashed on the CPU from the
seeds (B x ~60 values; pass CPU seeds and nothing waits for the device); the per-pixel erasing noise is
hashed on the images' device.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass, field

import torch
from timm.data import IMAGENET_DEFAULT_MEAN, IMAGENET_DEFAULT_STD

from ..augment_policy import ALL_OPS, GEOMETRIC_OPS, LEVEL_DENOM, RandAugmentPolicy, unsupported_on_device
from ..splitmix import draw, keys_of, srl


@dataclass(frozen=True)
class DeviceAugmentConfig:
    """What ``augment_batch`` does: DeiT's defaults (the paper's Section 3) unless told otherwise."""

    rand_augment: str | None = "rand-m9-mstd0.5-inc1"
    """timm RandAugment policy string; None turns RandAugment off."""
    reprob: float = 0.25
    """Probability of one random-erasing box per image (timm RandomErasing, mode 'pixel', count 1)."""
    translate_pct: float = 0.45
    """TranslateXRel/YRel range as a fraction of the image side at magnitude 10 (timm's default)."""
    mean: tuple[float, float, float] = tuple(IMAGENET_DEFAULT_MEAN)
    """Normalisation mean per channel (0..1 scale); its 0..255 rounding is the geometric ops' fill colour."""
    std: tuple[float, float, float] = tuple(IMAGENET_DEFAULT_STD)
    """Normalisation std per channel (0..1 scale)."""
    policy: RandAugmentPolicy | None = field(init=False, repr=False, compare=False)

    def __post_init__(self):
        if not 0.0 <= self.reprob <= 1.0:
            raise ValueError(f"DeviceAugmentConfig.reprob={self.reprob!r}: must be a probability in [0, 1]")
        if not 0.0 <= self.translate_pct <= 1.0:
            raise ValueError(f"DeviceAugmentConfig.translate_pct={self.translate_pct!r}: must be in [0, 1]")
        for name in ("mean", "std"):
            value = getattr(self, name)
            if len(value) != 3 or (name == "std" and min(value) <= 0):
                raise ValueError(f"DeviceAugmentConfig.{name}={value!r}: must be 3 per-channel values"
                                 + (", all > 0" if name == "std" else ""))
        policy = None if self.rand_augment is None else RandAugmentPolicy.parse(self.rand_augment)
        object.__setattr__(self, "policy", policy)

    @property
    def fill(self) -> tuple[int, int, int]:
        """timm's ``img_mean`` hparam: the colour PIL fills outside a rotated/sheared/translated image."""
        return tuple(min(255, round(255 * m)) for m in self.mean)


def augment_on_device(d, device: torch.device) -> bool:
    """``data.augment_on`` resolved for a run on ``device``: auto = on CUDA, when the device supports the recipe, and
    wherever the resize or the decode is asked to run on the device."""
    if d.augment_on == "auto":
        asked = "device" in (getattr(d, "resize_on", "auto"), getattr(d, "decode_on", "cpu"))
        return (asked or device.type == "cuda") and unsupported_on_device(d) is None
    return d.augment_on == "device"


def handover_of(d, device: torch.device) -> str:
    """What a training loader hands over for a run on ``device`` (``LoaderSpec.handover``): "jpeg" (undecoded views,
    ``data.decode_on: device``), "box" (crop boxes at their own size, ``data.resize_on``: device, or auto with the
    augmentation on a CUDA device) or "pixels" (the crops at the model's input size)."""
    if not augment_on_device(d, device):
        return "pixels"
    if d.decode_on == "device":
        return "jpeg"
    return "box" if d.resize_on == "device" or (d.resize_on == "auto" and device.type == "cuda") else "pixels"


def config_of(d) -> DeviceAugmentConfig:
    """The device half of the recipe's train augmentation (DataConfig ``d``): RandAugment and random erasing."""
    return DeviceAugmentConfig(rand_augment=d.rand_augment, reprob=d.reprob)


# ---------------------------------------------------------------------------------------------------------
# Counter-based randomness: splitmix64 (splitmix.py), keyed by each sample's seed
# ---------------------------------------------------------------------------------------------------------

_NOISE_COUNTER = 1 << 32  # erasing noise counters start here, far above the per-sample draws


def uniforms(seeds: torch.Tensor, count: int) -> torch.Tensor:
    """(B, count) float64 uniforms in [0, 1): draw k of sample b depends on seeds[b] and k only."""
    counters = torch.arange(count, dtype=torch.int64, device=seeds.device)
    return srl(draw(keys_of(seeds)[:, None], counters[None]), 11).to(torch.float64) * 2.0 ** -53


def ragged_normals(seeds: torch.Tensor, lengths: torch.Tensor, total: int) -> torch.Tensor:
    """float32 standard normals, ``lengths[b]`` for sample b, concatenated (``total`` of them, known on the host):
    value k of sample b depends only on (seeds[b], k). Box-Muller on two 24-bit halves of one hash; seeds and
    lengths on the output device."""
    dev = seeds.device
    starts = torch.cumsum(lengths, 0) - lengths
    keys = torch.repeat_interleave(keys_of(seeds), lengths, output_size=total)
    k = torch.arange(total, device=dev) - torch.repeat_interleave(starts, lengths, output_size=total)
    z = draw(keys, _NOISE_COUNTER + k)
    u1 = (srl(z, 40) + 1).to(torch.float32) * 2.0 ** -24  # (0, 1]: the log is finite
    u2 = ((z >> 16) & 0xFFFFFF).to(torch.float32) * 2.0 ** -24
    return torch.sqrt(-2.0 * torch.log(u1)) * torch.cos(2.0 * math.pi * u2)


# ---------------------------------------------------------------------------------------------------------
# The per-sample plan: which ops, with which arguments, and the erasing box
# ---------------------------------------------------------------------------------------------------------

_DRAWS_PER_LAYER = 5  # op choice, apply or not, two for the gaussian, sign
_ERASE_ATTEMPTS = 10  # timm tries 10 boxes and erases the first that fits
_ERASE_MIN_AREA, _ERASE_MAX_AREA = 0.02, 1 / 3
_ERASE_LOG_ASPECT = (math.log(0.3), math.log(1 / 0.3))


@dataclass
class AugmentPlan:
    """Every random choice for a batch, on the CPU (L = policy.num_layers; args are timm's level_fn outputs)."""

    op: torch.Tensor
    """(L, B) int64 index into policy.ops, -1 where that layer's op is not applied (prob 1 - p)."""
    magnitude: torch.Tensor
    """(L, B) float64 magnitude after noise and clipping to [0, magnitude_max]."""
    arg: torch.Tensor
    """(L, B) float64 the op's argument: degrees, factor, bits, threshold, addend, shear, fraction of the side."""
    erase_box: torch.Tensor
    """(B, 4) int64 top, left, height, width of the erased box; height 0 where nothing is erased."""


def _level_to_arg(name: str, m: torch.Tensor, sign: torch.Tensor, translate_pct: float) -> torch.Tensor:
    """timm's LEVEL_TO_ARG in float64, operation for operation (level = magnitude / 10)."""
    level = m / LEVEL_DENOM
    if name in ("AutoContrast", "Equalize", "Invert"):
        return torch.zeros_like(m)
    if name == "Rotate":
        return level * 30.0 * sign
    if name == "Posterize":
        return torch.trunc(level * 4)
    if name == "PosterizeIncreasing":
        return 4 - torch.trunc(level * 4)
    if name == "Solarize":
        return torch.trunc(level * 256).clamp(max=256)
    if name == "SolarizeIncreasing":
        return 256 - torch.trunc(level * 256).clamp(max=256)
    if name == "SolarizeAdd":
        return torch.trunc(level * 110).clamp(max=128)
    if name in ("Color", "Contrast", "Brightness", "Sharpness"):
        return level * 1.8 + 0.1
    if name in ("ColorIncreasing", "ContrastIncreasing", "BrightnessIncreasing", "SharpnessIncreasing"):
        return (1.0 + level * 0.9 * sign).clamp(min=0.1)
    if name in ("ShearX", "ShearY"):
        return level * 0.3 * sign
    if name in ("TranslateXRel", "TranslateYRel"):
        return level * translate_pct * sign
    raise ValueError(f"RandAugment op {name!r} is not supported; supported: {', '.join(ALL_OPS)}")


def sample_plan(seeds: torch.Tensor, cfg: DeviceAugmentConfig, height: int, width: int) -> AugmentPlan:
    """Draw every per-sample choice from the seeds (on the CPU; timm's distributions, our counter-based draws)."""
    seeds = seeds.detach().to("cpu", torch.int64)
    policy = cfg.policy
    num_layers = policy.num_layers if policy is not None else 0
    erase_base = num_layers * _DRAWS_PER_LAYER
    u = uniforms(seeds, erase_base + 1 + 4 * _ERASE_ATTEMPTS)  # (B, draws)
    batch = seeds.shape[0]

    op = torch.full((num_layers, batch), -1, dtype=torch.int64)
    magnitude = torch.zeros((num_layers, batch), dtype=torch.float64)
    arg = torch.zeros((num_layers, batch), dtype=torch.float64)
    for layer in range(num_layers):
        d = u[:, layer * _DRAWS_PER_LAYER:(layer + 1) * _DRAWS_PER_LAYER]
        choice = (d[:, 0] * len(policy.ops)).long().clamp(max=len(policy.ops) - 1)  # np.random.choice, uniform
        applied = d[:, 1] <= policy.prob  # timm skips when random() > prob
        if policy.magnitude_std == math.inf:
            m = d[:, 2] * policy.magnitude  # random.uniform(0, magnitude)
        elif policy.magnitude_std > 0:
            gauss = torch.sqrt(-2.0 * torch.log1p(-d[:, 2])) * torch.cos(2.0 * math.pi * d[:, 3])
            m = policy.magnitude + policy.magnitude_std * gauss  # random.gauss(magnitude, std)
        else:
            m = torch.full((batch,), policy.magnitude, dtype=torch.float64)
        m = m.clamp(0.0, policy.magnitude_max)
        sign = torch.where(d[:, 4] > 0.5, -1.0, 1.0).to(torch.float64)  # timm's _randomly_negate
        for k, name in enumerate(policy.ops):
            sel = choice == k
            if sel.any():
                arg[layer, sel] = _level_to_arg(name, m[sel], sign[sel], cfg.translate_pct)
        op[layer] = torch.where(applied, choice, -1)
        magnitude[layer] = m

    erase_box = torch.zeros((batch, 4), dtype=torch.int64)
    if cfg.reprob > 0:
        area = height * width
        a = u[:, erase_base + 1:].view(batch, _ERASE_ATTEMPTS, 4)  # (B, attempts, 4)
        target_area = (_ERASE_MIN_AREA + (_ERASE_MAX_AREA - _ERASE_MIN_AREA) * a[..., 0]) * area
        lo, hi = _ERASE_LOG_ASPECT
        aspect = torch.exp(lo + (hi - lo) * a[..., 1])
        h = torch.round(torch.sqrt(target_area * aspect)).long()  # Python's round: half to even, as torch's
        w = torch.round(torch.sqrt(target_area / aspect)).long()
        fits = (w < width) & (h < height)
        top = (a[..., 2] * (height - h + 1)).long()  # random.randint(0, H - h)
        left = (a[..., 3] * (width - w + 1)).long()
        first = torch.where(fits.any(1), fits.float().argmax(1), 0)  # the first attempt that fits
        pick = lambda t: t.gather(1, first[:, None]).squeeze(1)  # noqa: E731
        erase = (u[:, erase_base] <= cfg.reprob) & fits.any(1)  # timm skips when random() > probability
        box = torch.stack([pick(top), pick(left), pick(h), pick(w)], 1)
        erase_box = torch.where(erase[:, None], box, 0)
    return AugmentPlan(op=op, magnitude=magnitude, arg=arg, erase_box=erase_box)


# ---------------------------------------------------------------------------------------------------------
# The ops, on float32 images holding uint8 values (n, 3, H, W) and one float64 argument per sample (n,)
# ---------------------------------------------------------------------------------------------------------

def _per_image(arg: torch.Tensor, dtype=torch.float32) -> torch.Tensor:
    return arg.to(dtype).view(-1, 1, 1, 1)


def _blend(degenerate: torch.Tensor, img: torch.Tensor, factor: torch.Tensor) -> torch.Tensor:
    """PIL's Image.blend(degenerate, img, factor): float32 arithmetic, clipped, truncated to uint8."""
    return (degenerate + _per_image(factor) * (img - degenerate)).clamp(0.0, 255.0).floor()


def _luma(img: torch.Tensor) -> torch.Tensor:
    """PIL's RGB -> L: (R*19595 + G*38470 + B*7471 + 0x8000) >> 16, exact in float32 (< 2**24). (n, 1, H, W)"""
    r, g, b = img[:, 0:1], img[:, 1:2], img[:, 2:3]
    return torch.floor((r * 19595 + g * 38470 + b * 7471 + 32768) / 65536)


def _auto_contrast(img, _arg):
    # ImageOps.autocontrast per channel: lo/hi are the lowest/highest values present; lut[i] = int(i*scale + offset)
    n, c, h, w = img.shape
    values = img.long().view(n, c, h * w)
    lo = values.amin(2, keepdim=True).double()
    hi = values.amax(2, keepdim=True).double()
    span = (hi - lo).clamp(min=1)
    scale = torch.full_like(span, 255.0) / span  # PIL's 255.0 / (hi - lo): `255.0 / span` is 255 x (1 / span)
    offset = -lo * scale
    levels = torch.arange(256, dtype=torch.float64, device=img.device)
    lut = torch.trunc(levels * scale + offset).clamp(0, 255)  # (n, c, 256)
    lut = torch.where(hi > lo, lut, levels).float()
    return lut.gather(2, values).view(n, c, h, w)


def _equalize(img, _arg):
    # ImageOps.equalize per channel: lut[i] = (step // 2 + #pixels below i) // step, step from the histogram
    n, c, h, w = img.shape
    values = img.long().view(n, c, h * w)
    hist = torch.zeros((n, c, 256), dtype=torch.int64, device=img.device)
    hist.scatter_add_(2, values, torch.ones_like(values))
    last = hist.gather(2, values.amax(2, keepdim=True))  # count of the highest value present
    step = (h * w - last) // 255  # (n, c, 1)
    below = hist.cumsum(2) - hist
    lut = ((step // 2 + below) // step.clamp(min=1)).clamp(max=255)  # PIL clips the table to uint8
    identity = ((hist > 0).sum(2, keepdim=True) <= 1) | (step == 0)
    out = lut.gather(2, values).view(n, c, h, w).float()
    return torch.where(identity.view(n, c, 1, 1), img, out)


def _invert(img, _arg):
    return 255.0 - img


def _posterize(img, bits):
    # ImageOps.posterize: keep the top `bits` bits; bits 0 gives black (Pillow < 13; Pillow 13 refuses 0)
    quantum = torch.pow(2.0, 8 - _per_image(bits)).to(img.dtype)
    out = torch.floor(img / quantum) * quantum
    return torch.where(_per_image(bits) >= 8, img, out)


def _solarize(img, threshold):
    return torch.where(img < _per_image(threshold), img, 255.0 - img)


def _solarize_add(img, add):
    return torch.where(img < 128, (img + _per_image(add)).clamp(max=255.0), img)


def _color(img, factor):
    return _blend(_luma(img).expand_as(img), img, factor)


def _contrast(img, factor):
    # the degenerate image is the mean of the L image, rounded: int(sum / n + 0.5), in integers (the same on every
    # device: CUDA divides by a number as a multiplication by its reciprocal, which rounds some ties down)
    n = img.shape[2] * img.shape[3]
    total = _luma(img).sum(dim=(1, 2, 3), dtype=torch.int64)
    degenerate = torch.div(2 * total + n, 2 * n, rounding_mode="floor").float().view(-1, 1, 1, 1).expand_as(img)
    return _blend(degenerate, img, factor)


def _brightness(img, factor):
    return _blend(torch.zeros_like(img), img, factor)


def _sharpness(img, factor):
    # ImageFilter.SMOOTH: 3x3 kernel [[1,1,1],[1,5,1],[1,1,1]] / 13, rounded; the one-pixel border is copied
    s = img[:, :, 1:-1, 1:-1] * 4
    for dy in (0, 1, 2):
        for dx in (0, 1, 2):
            s = s + img[:, :, dy:dy + img.shape[2] - 2, dx:dx + img.shape[3] - 2]
    smooth = img.clone()
    # round half up of s / 13 (never a tie), in integers (CUDA divides a float by a number as a multiplication by
    # its reciprocal)
    smooth[:, :, 1:-1, 1:-1] = torch.div((2 * s + 13).int(), 26, rounding_mode="floor")
    return _blend(smooth, img, factor)


_COLOUR_OPS = {
    "AutoContrast": _auto_contrast, "Equalize": _equalize, "Invert": _invert,
    "Posterize": _posterize, "PosterizeIncreasing": _posterize,
    "Solarize": _solarize, "SolarizeIncreasing": _solarize, "SolarizeAdd": _solarize_add,
    "Color": _color, "ColorIncreasing": _color, "Contrast": _contrast, "ContrastIncreasing": _contrast,
    "Brightness": _brightness, "BrightnessIncreasing": _brightness,
    "Sharpness": _sharpness, "SharpnessIncreasing": _sharpness,
}


def _affine_coeffs(name: str, arg: torch.Tensor, height: int, width: int) -> torch.Tensor:
    """PIL's AFFINE data (a, b, c, d, e, f): output pixel centre (x, y) samples input (ax+by+c, dx+ey+f). (n, 6)"""
    one, zero = torch.ones_like(arg), torch.zeros_like(arg)
    if name == "ShearX":
        return torch.stack([one, arg, zero, zero, one, zero], 1)
    if name == "ShearY":
        return torch.stack([one, zero, zero, arg, one, zero], 1)
    if name == "TranslateXRel":
        return torch.stack([one, zero, arg * width, zero, one, zero], 1)
    if name == "TranslateYRel":
        return torch.stack([one, zero, zero, zero, one, arg * height], 1)
    # Rotate: Image.rotate(degrees) about the centre, without expand (timm's path for Pillow >= 5.2)
    angle = -torch.deg2rad(torch.remainder(arg, 360.0))
    cos, sin = torch.round(torch.cos(angle), decimals=15), torch.round(torch.sin(angle), decimals=15)
    cx, cy = width / 2, height / 2
    c = cos * -cx + sin * -cy + cx
    f = -sin * -cx + cos * -cy + cy
    return torch.stack([cos, sin, c, -sin, cos, f], 1)


def _cubic(v1, v2, v3, v4, t):
    # PIL's BICUBIC macro (the a = -1 cubic) in Horner form: exact on flat regions, as PIL is
    return v2 + t * ((v3 - v1) + t * ((2 * (v1 - v2) + v3 - v4) + t * (-v1 + v2 - v3 + v4)))


def affine_sample(img: torch.Tensor, coeffs: torch.Tensor, fill: tuple[int, int, int]) -> torch.Tensor:
    """PIL's Image.transform(AFFINE, BICUBIC, fillcolor=fill) for a batch: one matrix per sample.

    img (n, 3, H, W) float32 uint8 values; coeffs (n, 6) float64 on img's device, as ``_affine_coeffs``. An output
    pixel whose
    source point falls outside the image gets ``fill``; inside, the 4x4 taps are clamped to the edge.
    """
    n, c, h, w = img.shape
    dev = img.device
    co = coeffs.view(n, 6, 1, 1).unbind(1)  # each (n, 1, 1), float64 on img's device
    xs = torch.arange(w, dtype=torch.float64, device=dev).view(1, 1, w) + 0.5
    ys = torch.arange(h, dtype=torch.float64, device=dev).view(1, h, 1) + 0.5
    xin = co[0] * xs + co[1] * ys + co[2]  # (n, H, W) source coordinates, pixel centres at +0.5
    yin = co[3] * xs + co[4] * ys + co[5]
    inside = (xin >= 0) & (xin < w) & (yin >= 0) & (yin < h)
    x0, y0 = torch.floor(xin - 0.5), torch.floor(yin - 0.5)
    dx = (xin - 0.5 - x0).float().unsqueeze(-1)  # (n, H, W, 1)
    dy = (yin - 0.5 - y0).float().unsqueeze(-1)
    x0, y0 = x0.long() - 1, y0.long() - 1
    cols = [(x0 + k).clamp(0, w - 1) for k in range(4)]
    first_pixel = (torch.arange(n, device=dev) * (h * w)).view(n, 1, 1)
    rows = [(y0 + k).clamp(0, h - 1) * w + first_pixel for k in range(4)]
    pixels = img.permute(0, 2, 3, 1).reshape(n * h * w, c)  # channel-last: one index fetches 3 values

    def tap(row, col):  # (n, H, W, 3)
        return pixels.index_select(0, (row + col).view(-1)).view(n, h, w, c)

    v = _cubic(*[_cubic(*[tap(r, col) for col in cols], dx) for r in rows], dy)
    v = v.clamp(0.0, 255.0).floor()
    return torch.where(inside.unsqueeze(-1), v, constant(fill, img.dtype, dev)).permute(0, 3, 1, 2)


def apply_op(name: str, img: torch.Tensor, arg: torch.Tensor, fill: tuple[int, int, int] = (124, 116, 104)
             ) -> torch.Tensor:
    """One RandAugment op on float32 images with uint8 values (n, 3, H, W), one timm level argument per sample (a
    reference entry point: ``augment_batch`` moves its arguments once per batch)."""
    arg = arg.to(img.device, torch.float64)
    if name in GEOMETRIC_OPS:
        coeffs = _affine_coeffs(name, arg.cpu(), img.shape[2], img.shape[3]).to(img.device)
        return affine_sample(img, coeffs, fill)
    if name not in _COLOUR_OPS:
        raise ValueError(f"RandAugment op {name!r} is not supported; supported: {', '.join(ALL_OPS)}")
    return _COLOUR_OPS[name](img, arg)


# ---------------------------------------------------------------------------------------------------------
# The public entry points
# ---------------------------------------------------------------------------------------------------------

def _check_batch(x: torch.Tensor) -> None:
    if not isinstance(x, torch.Tensor) or x.dtype != torch.uint8 or x.dim() != 4 or x.shape[1] != 3:
        got = f"dtype={x.dtype}, shape={tuple(x.shape)}" if isinstance(x, torch.Tensor) else type(x).__name__
        raise ValueError(f"images must be a uint8 tensor (B, 3, H, W); got {got}")


@functools.lru_cache(maxsize=64)
def constant(values: tuple, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A small constant (mean, std, a fill colour) on ``device``, made once per device: the copy of host data to a
    GPU waits for the stream, so it must not happen per batch."""
    return torch.tensor(values, dtype=dtype, device=device)


def to_device(tensors: list[torch.Tensor], device: torch.device) -> list[torch.Tensor]:
    """Per-batch host tensors on ``device`` with one transfer per dtype: concatenated into one page-locked buffer (on
    CUDA) and copied asynchronously, so nothing waits for the device (a copy from pageable memory does, and one copy
    per tensor would cost a stream synchronisation each). On the CPU they come back as they are."""
    if device.type == "cpu":
        return list(tensors)
    out: list = [None] * len(tensors)
    by_dtype: dict[torch.dtype, list[int]] = {}
    for i, t in enumerate(tensors):
        by_dtype.setdefault(t.dtype, []).append(i)
    for dtype, idxs in by_dtype.items():
        flat = torch.cat([tensors[i].reshape(-1) for i in idxs])
        flat = (flat.pin_memory() if device.type == "cuda" else flat).to(device, non_blocking=True)
        for i, part in zip(idxs, flat.split([tensors[i].numel() for i in idxs])):
            out[i] = part.view(tensors[i].shape)
    return out


def normalize(x: torch.Tensor, cfg: DeviceAugmentConfig | None = None) -> torch.Tensor:
    """ToTensor + Normalize of a uint8 batch (B, 3, H, W) -> float32, as torchvision computes them."""
    _check_batch(x)
    x = x.contiguous()  # FFCV's crops arrive channels-last: transposed here, on the device, not in the loader
    cfg = cfg or DeviceAugmentConfig()
    mean = constant(tuple(cfg.mean), torch.float32, x.device).view(1, 3, 1, 1)
    std = constant(tuple(cfg.std), torch.float32, x.device).view(1, 3, 1, 1)
    # ToTensor's x / 255 as a division by a tensor: CUDA divides by a number as a multiplication by its reciprocal
    return x.float().div(constant((255.0,), torch.float32, x.device)).sub(mean).div(std)


def _rand_augment_jobs(plan: AugmentPlan, cfg: DeviceAugmentConfig, h: int, w: int) -> list[tuple]:
    """(op name, sample indices, argument) per op of each layer, on the CPU, in the order they apply: each sample has
    one op per layer, so a layer's op subsets are disjoint; its geometric ones share one sampler ("affine", with
    PIL's affine coefficients as the argument)."""
    jobs = []
    for layer in range(plan.op.shape[0]):
        geo_idx, geo_coeffs = [], []
        for k, name in enumerate(cfg.policy.ops):
            idx = (plan.op[layer] == k).nonzero().squeeze(1)
            if idx.numel() == 0:
                continue
            arg = plan.arg[layer, idx]
            if name in GEOMETRIC_OPS:
                geo_idx.append(idx)
                geo_coeffs.append(_affine_coeffs(name, arg, h, w))
            else:
                jobs.append((name, idx, arg))
        if geo_idx:
            jobs.append(("affine", torch.cat(geo_idx), torch.cat(geo_coeffs)))
    return jobs


def _erase_job(seeds: torch.Tensor, box: torch.Tensor, channels: int) -> tuple | None:
    """(sample indices, their boxes, their seeds, noise values per sample) of random erasing, on the CPU."""
    idx = (box[:, 2] > 0).nonzero().squeeze(1)
    if idx.numel() == 0:
        return None
    return idx, box[idx], seeds[idx], channels * box[idx, 2] * box[idx, 3]


def _random_erase(out: torch.Tensor, job: tuple, total: int) -> torch.Tensor:
    """timm RandomErasing (mode 'pixel'): the box gets per-pixel standard normal noise, after normalisation.

    Noise value k of a sample is its k-th box pixel in (channel, row, column) order, hashed only for box pixels.
    ``job``: ``_erase_job``'s tensors, on ``out``'s device; ``total``: the number of noise values."""
    idx, box, seeds, lengths = job
    n, (_, c, h, w) = idx.numel(), out.shape
    top, left, bh, bw = box.view(n, 4, 1, 1).unbind(1)
    rows = torch.arange(h, device=out.device).view(1, h, 1)
    cols = torch.arange(w, device=out.device).view(1, 1, w)
    inside = (rows >= top) & (rows < top + bh) & (cols >= left) & (cols < left + bw)  # (n, H, W)
    noise = ragged_normals(seeds, lengths, total)
    erased = out[idx]
    erased.masked_scatter_(inside.unsqueeze(1).expand(n, c, h, w), noise)  # row-major: the k-th box pixel
    out[idx] = erased
    return out


def augment_batch(x: torch.Tensor, seeds: torch.Tensor, cfg: DeviceAugmentConfig | None = None) -> torch.Tensor:
    """RandAugment, ToTensor/Normalize and random erasing of a uint8 batch, every choice drawn from ``seeds``.

    x: uint8 (B, 3, H, W) on any device, already cropped and flipped. seeds: int64 (B,), one per sample, on the CPU
    (page-locked from the loader). Every choice is made on the host from the seeds; the per-sample arguments reach
    the device in one asynchronous transfer per dtype (``to_device``) and nothing is read back: no stream
    synchronisation. Returns float32 (B, 3, H, W) on x's device.
    """
    _check_batch(x)
    if not isinstance(seeds, torch.Tensor) or seeds.dtype != torch.int64 or seeds.shape != (x.shape[0],):
        got = (f"dtype={seeds.dtype}, shape={tuple(seeds.shape)}" if isinstance(seeds, torch.Tensor)
               else type(seeds).__name__)
        raise ValueError(f"seeds must be an int64 tensor of shape ({x.shape[0]},), one per image; got {got}")
    x = x.contiguous()  # FFCV's crops arrive channels-last: transposed here, on the device, not in the loader
    cfg = cfg or DeviceAugmentConfig()
    seeds = seeds.detach().cpu()
    plan = sample_plan(seeds, cfg, x.shape[2], x.shape[3])
    jobs = _rand_augment_jobs(plan, cfg, x.shape[2], x.shape[3]) if cfg.policy is not None else []
    erase = _erase_job(seeds, plan.erase_box, x.shape[1]) if cfg.reprob > 0 else None
    host = [t for _, idx, arg in jobs for t in (idx, arg)] + list(erase or ())
    moved = iter(to_device(host, x.device))
    if cfg.policy is not None:
        img = x.float()
        for name, _, _ in jobs:
            idx, arg = next(moved), next(moved)
            img[idx] = (affine_sample(img[idx], arg, cfg.fill) if name == "affine"
                        else _COLOUR_OPS[name](img[idx], arg))
        x = img.to(torch.uint8)  # exact: every op leaves integer values in [0, 255]
    out = normalize(x, cfg)
    if erase is not None:
        out = _random_erase(out, tuple(moved), int(erase[3].sum()))
    return out
