"""GroupMixup (convit_scale/data/mixup.py) against timm's Mixup: one canonical group is mixed exactly as
``timm.data.Mixup(mode="batch")`` mixes a batch of that size when timm's draws come from the group's generator, and
groups are independent of each other and of how they are shared among ranks."""

from __future__ import annotations

import numpy as np
import pytest
import timm.data.mixup as timm_mixup
import torch

from convit_scale.config import DataConfig
from convit_scale.data.mixup import GroupMixup
from convit_scale.data.order import MIXUP_STREAM, view_seeds

CLASSES, GROUP, GROUPS, SEED, H, W = 10, 8, 4, 17, 16, 12

SETTINGS = {  # name -> DataConfig fields
    "mixup only": dict(mixup=0.8, cutmix=0.0, mixup_prob=1.0, label_smoothing=0.1),
    "cutmix only": dict(mixup=0.0, cutmix=1.0, mixup_prob=1.0, label_smoothing=0.1),
    "both, switch 0.5, prob 0.7": dict(mixup=0.8, cutmix=1.0, mixup_prob=0.7, mixup_switch_prob=0.5,
                                       label_smoothing=0.1),
}


class _TimmRandom:
    """The ``np.random`` calls timm's Mixup makes (rand, beta, randint), answered by one numpy Generator."""

    def __init__(self, rng: np.random.Generator):
        self.rng = rng

    def rand(self):
        return self.rng.random()

    def beta(self, a, b):
        return self.rng.beta(a, b)

    def randint(self, low, high, size=None):
        return self.rng.integers(low, high, size=size)


class _NumpyDrawingFrom:
    """numpy, except that ``random`` draws from ``rng``: stands in for the ``np`` that timm's mixup module uses."""

    def __init__(self, rng: np.random.Generator):
        self.random = _TimmRandom(rng)

    def __getattr__(self, name):
        return getattr(np, name)


def _group_mixup(**fields) -> GroupMixup:
    d = DataConfig(global_batch_size=GROUP * GROUPS, canonical_groups=GROUPS, **fields)
    return GroupMixup(d, CLASSES, GROUP, GROUPS, SEED)


def _batch(groups: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(groups * GROUP, 3, H, W, generator=gen),
            torch.randint(0, CLASSES, (groups * GROUP,), generator=gen))


def _timm_on_group(monkeypatch, fields: dict, epoch: int, step: int, group: int, x, y):
    """timm's Mixup on one group's samples, its np.random calls answered by the group's own generator."""
    group_seed = int(view_seeds(SEED, epoch, [step * GROUPS + group], stream=MIXUP_STREAM)[0])
    monkeypatch.setattr(timm_mixup, "np", _NumpyDrawingFrom(np.random.default_rng(group_seed)))
    mix = timm_mixup.Mixup(mixup_alpha=fields["mixup"], cutmix_alpha=fields["cutmix"], prob=fields["mixup_prob"],
                           switch_prob=fields.get("mixup_switch_prob", 0.5), mode="batch", correct_lam=True,
                           label_smoothing=fields["label_smoothing"], num_classes=CLASSES)
    return mix(x.clone(), y.clone())


@pytest.mark.parametrize("name", list(SETTINGS))
def test_one_group_is_mixed_as_timm_mixes_a_batch(monkeypatch, name):
    """Same lambda, same box, same smoothed targets: images and targets equal timm's bit for bit, over enough groups
    that every branch (not mixed, Mixup, CutMix) of the setting is taken."""
    fields = SETTINGS[name]
    gm = _group_mixup(**fields)
    kinds = set()
    for step in range(6):
        for group in range(GROUPS):
            x, y = _batch(1, seed=100 * step + group)
            plan = gm.plan(epoch=3, step=step, first_group=group, count=1, height=H, width=W)
            ours_x, ours_y = gm.apply(x, y, plan)
            timm_x, timm_y = _timm_on_group(monkeypatch, fields, 3, step, group, x, y)
            assert torch.equal(ours_x, timm_x), (name, step, group)
            assert torch.equal(ours_y, timm_y), (name, step, group)
            own, _, lam, _, box = plan
            kinds.add("cutmix" if bool(box.any()) else "none" if float(lam[0]) == 1.0 else "mixup")
    expected = {"mixup only": {"mixup"}, "cutmix only": {"cutmix"},
                "both, switch 0.5, prob 0.7": {"none", "mixup", "cutmix"}}[name]
    assert kinds == expected


def test_a_group_does_not_change_when_another_group_changes():
    fields = SETTINGS["both, switch 0.5, prob 0.7"]
    gm = _group_mixup(**fields)
    x, y = _batch(GROUPS, seed=1)
    plan = gm.plan(epoch=0, step=1, first_group=0, count=GROUPS, height=H, width=W)  # a CutMix, 3 Mixups
    mixed_x, mixed_y = gm.apply(x, y, plan)
    other_x, other_y = x.clone(), y.clone()
    rows = slice(2 * GROUP, 3 * GROUP)  # group 2's samples replaced
    other_x[rows], other_y[rows] = torch.randn(GROUP, 3, H, W), (y[rows] + 1) % CLASSES
    changed_x, changed_y = gm.apply(other_x, other_y, plan)
    keep = torch.ones(GROUPS * GROUP, dtype=torch.bool)
    keep[rows] = False
    assert torch.equal(changed_x[keep], mixed_x[keep]) and torch.equal(changed_y[keep], mixed_y[keep])
    assert not torch.equal(changed_x[rows], mixed_x[rows])
    # the groups of a step draw differently (a single draw shared by all would also pass the above)
    firsts = {tuple(torch.cat([t[g * GROUP].reshape(-1).double() for t in plan]).tolist()) for g in range(GROUPS)}
    assert len(firsts) == GROUPS


@pytest.mark.parametrize("ranks", [1, 2, 3, 4])
def test_the_mixed_batch_is_the_same_at_any_world_size(ranks):
    """Each rank plans and mixes only its own contiguous share of the step's groups (unequal shares included): the
    concatenation is the 1-rank batch."""
    gm = _group_mixup(**SETTINGS["both, switch 0.5, prob 0.7"])
    x, y = _batch(GROUPS, seed=2)
    whole_x, whole_y = gm.apply(x, y, gm.plan(epoch=1, step=5, first_group=0, count=GROUPS, height=H, width=W))
    parts_x, parts_y = [], []
    for shares in np.array_split(np.arange(GROUPS), ranks):
        first, count = int(shares[0]), len(shares)
        rows = slice(first * GROUP, (first + count) * GROUP)
        px, py = gm.apply(x[rows], y[rows], gm.plan(epoch=1, step=5, first_group=first, count=count, height=H,
                                                    width=W))
        parts_x.append(px)
        parts_y.append(py)
    assert torch.equal(torch.cat(parts_x), whole_x) and torch.equal(torch.cat(parts_y), whole_y)
