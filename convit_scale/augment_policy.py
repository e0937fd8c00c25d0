"""timm's RandAugment policy strings, parsed, and whether the device augmentation can run a recipe's.

Pure Python with no package import, so that the recipe's validation (config.py) can refuse
``data.augment_on: device`` for a policy the device cannot run before any process starts;
``data/device_augment.py`` runs the parsed policy.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

from .errors import BadInput

# ---------------------------------------------------------------------------------------------------------
# The policy, parsed from timm's string
# ---------------------------------------------------------------------------------------------------------

RAND_INCREASING_OPS = (
    "AutoContrast", "Equalize", "Invert", "Rotate", "PosterizeIncreasing", "SolarizeIncreasing", "SolarizeAdd",
    "ColorIncreasing", "ContrastIncreasing", "BrightnessIncreasing", "SharpnessIncreasing",
    "ShearX", "ShearY", "TranslateXRel", "TranslateYRel",
)
"""timm's ``_RAND_INCREASING_TRANSFORMS`` (``inc1``), in timm's order."""

RAND_OPS = (
    "AutoContrast", "Equalize", "Invert", "Rotate", "Posterize", "Solarize", "SolarizeAdd",
    "Color", "Contrast", "Brightness", "Sharpness", "ShearX", "ShearY", "TranslateXRel", "TranslateYRel",
)
"""timm's ``_RAND_TRANSFORMS`` (``inc0``, the default)."""

ALL_OPS = tuple(sorted(set(RAND_OPS) | set(RAND_INCREASING_OPS)))
GEOMETRIC_OPS = frozenset({"Rotate", "ShearX", "ShearY", "TranslateXRel", "TranslateYRel"})

LEVEL_DENOM = 10.0  # timm: magnitude M maps to the fractional level M / 10
_SUPPORTED = ("'rand' followed by sections m<int>, n<int>, p<float>, mstd<float>, mmax<int>, inc<0|1> "
              "(e.g. 'rand-m9-mstd0.5-inc1'); transform-set ('t...') and weighted variants are not supported")


@dataclass(frozen=True)
class RandAugmentPolicy:
    """timm's RandAugment as configured by a ``rand-...`` string (timm's defaults where a section is absent)."""

    magnitude: float = 10.0
    """'m': mean magnitude on timm's 0..10 scale."""
    num_layers: int = 2
    """'n': ops drawn (with replacement, uniformly) per image."""
    prob: float = 0.5
    """'p': probability that each drawn op is applied."""
    magnitude_std: float = 0.0
    """'mstd': std of the gaussian magnitude noise; inf (mstd > 100) draws uniformly in [0, magnitude]."""
    magnitude_max: float = LEVEL_DENOM
    """'mmax': the magnitude is clipped to [0, magnitude_max] (timm: 10 unless set to a non-zero value)."""
    increasing: bool = False
    """'inc': use the variants whose severity increases with magnitude."""

    @property
    def ops(self) -> tuple[str, ...]:
        return RAND_INCREASING_OPS if self.increasing else RAND_OPS

    @classmethod
    def parse(cls, policy: str) -> RandAugmentPolicy:
        """Parse timm's RandAugment string; anything timm would read differently is refused."""
        sections = policy.split("-") if isinstance(policy, str) else []
        if not sections or sections[0] != "rand":
            raise BadInput(f"RandAugment policy {policy!r} is not supported; supported: {_SUPPORTED}")
        values: dict = {}
        for section in sections[1:]:
            match = re.fullmatch(r"(mstd|mmax|inc|m|n|p)(\d.*)", section)
            if match is None:
                raise BadInput(f"RandAugment policy {policy!r}: section {section!r} is not supported; "
                               f"supported: {_SUPPORTED}")
            key, raw = match.groups()
            try:
                if key == "mstd":
                    std = float(raw)
                    values["magnitude_std"] = math.inf if std > 100 else std  # timm: uniform sampling
                elif key == "mmax":
                    values["magnitude_max"] = float(int(raw)) or LEVEL_DENOM  # timm: `magnitude_max or 10`
                elif key == "inc":
                    values["increasing"] = bool(int(raw))
                elif key == "m":
                    values["magnitude"] = float(int(raw))
                elif key == "n":
                    values["num_layers"] = int(raw)
                else:
                    values["prob"] = float(raw)
            except ValueError:
                raise BadInput(f"RandAugment policy {policy!r}: section {section!r} has a bad number; "
                               f"supported: {_SUPPORTED}") from None
        return cls(**values)


def unsupported_on_device(d) -> str | None:
    """Why ``augment_batch`` cannot run the train augmentation of the data section ``d`` (a DataConfig), or None.

    The CPU keeps the crop and the flip either way; RandAugment runs its geometric ops bicubic, as DeiT's."""
    if d.rand_augment is not None:
        try:
            RandAugmentPolicy.parse(d.rand_augment)
        except BadInput as e:
            return f"data.rand_augment = {d.rand_augment!r} does not run on the device ({e}); use data.augment_on=cpu"
        if d.interpolation != "bicubic":
            return (f"RandAugment's geometric ops run bicubic on the device, the recipe asks data.interpolation = "
                    f"{d.interpolation!r}; use bicubic or data.augment_on=cpu")
    elif d.color_jitter > 0:
        return (f"colour jitter (data.color_jitter = {d.color_jitter}, applied when data.rand_augment is null) does "
                f"not run on the device; set data.color_jitter=0 or data.augment_on=cpu")
    return None


