"""The epoch's order and seeds (convit_scale/data/order.py): pure functions of (N, seed, epoch, position), never of
the world size."""

from __future__ import annotations

import math

import numpy as np
import pytest

from convit_scale.data.order import (
    MIXUP_STREAM,
    STEP_STREAM,
    contiguous_range,
    epoch_permutation,
    epoch_views,
    step_seed,
    view_seeds,
    views_per_rank,
)


@pytest.mark.parametrize("repeats", [1, 3])
def test_epoch_views_repeat_the_permutations_first_images_consecutively(repeats):
    """DeiT's RASampler: N views, the permutation's first ceil(N / repeats) images, each ``repeats`` times in a row."""
    n = 100
    order = epoch_permutation(n, seed=5, epoch=2)
    assert sorted(order.tolist()) == list(range(n))
    views = epoch_views(n, seed=5, epoch=2, repeats=repeats)
    assert len(views) == n
    shown = math.ceil(n / repeats)
    expected = [int(order[i // repeats]) for i in range(n)]
    assert views.tolist() == expected and len(set(views.tolist())) == shown
    assert np.array_equal(epoch_views(n, seed=5, epoch=2, repeats=repeats), views)  # a pure function
    assert not np.array_equal(epoch_views(n, seed=5, epoch=3, repeats=repeats), views)  # another epoch, another order
    assert not np.array_equal(epoch_views(n, seed=6, epoch=2, repeats=repeats), views)


@pytest.mark.parametrize("items, parts", [(10, 3), (7, 7), (3, 5), (1000, 16)])
def test_contiguous_ranges_cut_the_items_into_near_equal_pieces(items, parts):
    ranges = [contiguous_range(items, parts, p) for p in range(parts)]
    assert ranges[0][0] == 0 and ranges[-1][1] == items
    assert all(a[1] == b[0] for a, b in zip(ranges, ranges[1:]))  # no gap, no overlap
    sizes = [stop - start for start, stop in ranges]
    assert max(sizes) - min(sizes) <= 1 and sizes == sorted(sizes, reverse=True)  # the first ones take the extra


def test_views_per_rank_pads_by_less_than_the_world():
    for n, world in ((10, 3), (12, 4), (1, 8)):
        per = views_per_rank(n, world)
        assert per * world >= n and per * world - n <= world - 1


def test_view_seeds_are_a_function_of_the_position_alone():
    positions = np.arange(1000)
    seeds = view_seeds(3, 1, positions)
    assert seeds.dtype == np.uint64 and int(seeds.max()) < 2**31
    assert len(set(seeds.tolist())) > 990  # 31-bit values: a few collisions at most
    assert np.array_equal(view_seeds(3, 1, positions[[7, 500, 2]]), seeds[[7, 500, 2]])  # any subset, any order
    assert not np.array_equal(view_seeds(3, 2, positions), seeds)  # the epoch
    assert not np.array_equal(view_seeds(4, 1, positions), seeds)  # the run's seed
    streams = [view_seeds(3, 1, positions, stream=s) for s in (0, STEP_STREAM, MIXUP_STREAM)]
    assert all((a != b).mean() > 0.99 for i, a in enumerate(streams) for b in streams[i + 1:])  # streams apart
    assert step_seed(3, 1, 9) == int(streams[1][9])
