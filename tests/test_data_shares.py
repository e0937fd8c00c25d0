"""Unequal shares of the canonical groups (data/geometry.py): which groups each rank holds, the positions of its
views, its micro-batches. Their assembly from one group a batch, and the loaders of every format on 3 ranks of a
4-group recipe: tests/test_data_steps.py."""

from __future__ import annotations

import numpy as np
import pytest

from convit_scale.config import group_shares, load_config, shares_note
from convit_scale.data import LoaderSpec
from convit_scale.data.geometry import EpochGeometry, MicroPart
from convit_scale.errors import BadInput
from convit_scale.train.distributed import check_world


def _spec(world: int, rank: int, micro: int, batch: int = 32, groups: int = 4) -> LoaderSpec:
    return LoaderSpec("train", 32, micro, world, rank, seed=5, global_batch_size=batch, canonical_groups=groups)


def test_ranks_hold_consecutive_groups_the_first_ones_one_more():
    assert group_shares(32, 24) == [2] * 8 + [1] * 16
    assert shares_note(32, 24) == ("24 ranks hold 32 canonical groups unequally: 8 ranks x 2, 16 x 1; step time as "
                                   "for 16 ranks x 2")
    assert shares_note(32, 16) is None and shares_note(4, 3).startswith("3 ranks hold 4 canonical groups unequally: "
                                                                        "1 rank x 2, 2 x 1")
    for world in range(1, 33):
        specs = [_spec(world, r, 16, 512, 32) for r in range(world)]
        firsts = [s.first_group for s in specs]
        assert firsts == [sum(group_shares(32, world)[:r]) for r in range(world)]
        assert sum(s.rank_groups for s in specs) == 32 and min(s.rank_groups for s in specs) >= 1


@pytest.mark.parametrize("world", range(1, 7))
def test_the_ranks_views_one_after_the_other_are_the_global_batch_in_canonical_order(world):
    """Every world size up to K = 6: step s of rank r holds its groups' positions, slot by slot, and the ranks' in
    rank order are [s*B, (s+1)*B) as one rank holds them."""
    b, k, n = 24, 6, 100
    one = EpochGeometry.of(n, _spec(1, 0, 24, b, k), "x").positions()
    per_rank = [EpochGeometry.of(n, _spec(world, r, 4, b, k), "x") for r in range(world)]
    assert {g.steps for g in per_rank} == {n // b} and len(one) == (n // b) * b
    for step in range(n // b):
        joined = np.concatenate([g.positions()[step * g.spec.rank_samples:(step + 1) * g.spec.rank_samples]
                                 for g in per_rank])
        assert joined.tolist() == one[step * b:(step + 1) * b].tolist()
    g = per_rank[-1]  # a resume: positions from batch j are the tail of the epoch's
    assert g.positions(2).tolist() == g.positions()[2 * g.spec.micro_batch_size:].tolist()


def test_every_rank_runs_as_many_micro_batches_the_short_ones_repeat_their_last_with_no_samples():
    spec = _spec(3, 0, 8)
    assert spec.accum == 2 and spec.micro_parts == [MicroPart(0, 1, 8), MicroPart(1, 1, 8)]
    assert _spec(3, 1, 8).micro_parts == [MicroPart(2, 1, 8), MicroPart(2, 1, 0)]
    assert _spec(3, 2, 16).micro_parts == [MicroPart(3, 1, 8)] and _spec(3, 0, 16).micro_parts == [MicroPart(0, 2, 16)]
    assert not _spec(3, 2, 16).whole_micro_batches and _spec(3, 0, 16).whole_micro_batches
    for world in range(1, 11):  # 10 groups of 2, micro-batches of 1 to 3 groups
        for groups in (1, 2, 3):
            specs = [_spec(world, r, 2 * groups, 20, 10) for r in range(world)]
            assert len({s.accum for s in specs}) == 1
            for s in specs:
                assert sum(p.samples for p in s.micro_parts) == s.rank_samples
                assert all(p.groups <= groups for p in s.micro_parts)


def test_check_world_gives_the_busiest_ranks_micro_batch_and_every_ranks_accumulation():
    cfg = load_config("recipes/table1/convit_base_plus.yaml")
    assert check_world(cfg, 24) == (32, 1) and check_world(cfg, 32) == (16, 1)
    cfg.data.micro_batch_size = 16
    assert check_world(cfg, 24) == (16, 2)
    with pytest.raises(BadInput, match="33 ranks exceed the 32 canonical groups"):
        check_world(cfg, 33)
