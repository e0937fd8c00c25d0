"""The epoch's geometry (convit_scale/data/geometry.py): each step's global batch the same at any world size, the last
partial batch dropped, repeats spread over canonical groups."""

import collections

import numpy as np

from convit_scale.data import LoaderSpec
from convit_scale.data.geometry import EpochGeometry


def _global_steps(n: int, world: int, batch: int, groups: int, repeats: int = 1, epoch: int = 0) -> list[list[int]]:
    """Each step's global batch (sample indices, in canonical order: rank 0's groups, then rank 1's, ...)."""
    ranks = []
    for r in range(world):
        spec = LoaderSpec("train", 32, batch // world, world, r, seed=0, global_batch_size=batch,
                          canonical_groups=groups)
        ranks.append(EpochGeometry.of(n, spec, "test").sample_indices(epoch, repeats)[0].reshape(-1, batch // world))
    return np.concatenate(ranks, axis=1).tolist()


def test_epoch_plan_is_the_same_at_any_world_size_with_repeats_spread_over_groups():
    for n, batch, groups in ((1000, 32, 4), (1001, 48, 4), (70, 8, 2)):
        steps = _global_steps(n, 1, batch, groups)
        assert len(steps) == n // batch  # the last partial global batch dropped, no padding
        for world in (2, groups):
            assert _global_steps(n, world, batch, groups) == steps
        flat = [i for step in steps for i in step]
        assert len(set(flat)) == len(flat) and set(flat) <= set(range(n))  # every view of the epoch at most once
    assert _global_steps(100, 2, 8, 2, epoch=1) != _global_steps(100, 2, 8, 2, epoch=0)
    rep = _global_steps(99, 2, 12, 4, repeats=3)  # 33 images x 3, each image's copies in different groups
    assert set(collections.Counter(i for step in rep for i in step).values()) <= {1, 2, 3}
    for step in rep:
        groups_of = collections.defaultdict(set)
        for slot, i in enumerate(step):
            groups_of[i].add(slot // 3)  # group g holds slots [3g, 3g + 3)
        assert all(len(g) == step.count(i) for i, g in groups_of.items())
