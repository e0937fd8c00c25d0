"""A rank's micro-batches assembled from one canonical group per batch (convit_scale/data/steps.py): ``accum`` of them
a step on every rank, whole groups joined in order, a part with no samples repeating the rank's last micro-batch with
no ids and no bad samples, a resume inside a step, and the loaders of every format on 3 ranks of a 4-group recipe,
whose batches one after the other are the 1-rank run's."""

from __future__ import annotations

import pytest
import torch

from convit_scale.config import DataConfig
from convit_scale.data import Batch, DataError, LoaderSpec, build_loader
from convit_scale.data.geometry import MicroPart
from convit_scale.data.steps import StepBatches


def _spec(world: int, rank: int, micro: int, batch: int = 32, groups: int = 4) -> LoaderSpec:
    return LoaderSpec("train", 32, micro, world, rank, seed=5, global_batch_size=batch, canonical_groups=groups)


class GroupLoader:
    """A format loader reading one canonical group a batch (``spec.per_group()``): batch b of an epoch is group
    ``first_group + b % groups`` of step ``b // groups``, its ids "e{epoch}s{step}g{group}i{i}"; ``bad_at`` batches
    carry a bad record; the epoch ends after ``yields`` batches (None: the whole epoch)."""

    def __init__(self, spec: LoaderSpec, steps: int, bad_at=(), yields: int | None = None):
        self.spec, self.steps, self.bad_at, self.yields = spec.per_group(), steps, set(bad_at), yields
        self.num_samples, self.num_real = steps * spec.global_batch, steps * spec.rank_samples
        self.starts, self.closed = [], 0

    def __len__(self) -> int:
        return self.steps * self.spec.batches_per_step

    def epoch(self, epoch: int, start_batch: int = 0):
        self.starts.append(start_batch)
        s, g = self.spec, self.spec.group_size
        try:
            for n, b in enumerate(range(start_batch, len(self))):
                if self.yields is not None and n >= self.yields:
                    return
                step, j = divmod(b, s.batches_per_step)
                ids = [f"e{epoch}s{step}g{s.first_group + j}i{i}" for i in range(g)]
                yield Batch(torch.full((g, 3, 2, 2), float(b)), torch.arange(g), torch.arange(g) + 100 * b,
                            [{"key": ids[0]}] if b in self.bad_at else [], ids)
        finally:
            self.closed += 1


def _ids(step: int, groups, g: int, epoch: int = 0) -> list[str]:
    return [f"e{epoch}s{step}g{k}i{i}" for k in groups for i in range(g)]


def test_whole_groups_are_joined_in_order_into_the_ranks_micro_batches():
    """32 in 8 groups of 4 on 3 ranks (3, 3, 2 groups), micro-batches of up to 2 groups: 2 a step on every rank,
    rank 0's of 2 and 1 groups, rank 2's of 1 and 1."""
    spec = _spec(3, 0, 8, groups=8)
    assert spec.accum == 2 and spec.micro_parts == [MicroPart(0, 2, 8), MicroPart(2, 1, 4)]
    inner = GroupLoader(spec, steps=3, bad_at={1})
    loader = StepBatches(inner, spec)
    assert len(loader) == 3 * 2 and (loader.num_samples, loader.num_real) == (inner.num_samples, inner.num_real)
    batches = list(loader.epoch(0))
    assert [b.ids for b in batches] == [ids for s in range(3) for ids in (_ids(s, (0, 1), 4), _ids(s, (2,), 4))]
    first = batches[0]
    assert first.images.shape == (8, 3, 2, 2) and first.images[:4].eq(0).all() and first.images[4:].eq(1).all()
    assert first.seeds.tolist() == [0, 1, 2, 3, 100, 101, 102, 103] and first.bad == [{"key": "e0s0g1i0"}]
    assert all(not b.bad for b in batches[1:])
    rank2 = list(StepBatches(GroupLoader(_spec(3, 2, 8, groups=8), 3), _spec(3, 2, 8, groups=8)).epoch(1))
    assert [b.ids for b in rank2] == [_ids(s, (k,), 4, epoch=1) for s in range(3) for k in (6, 7)]


def test_a_part_with_no_samples_repeats_the_last_micro_batch_without_ids_or_bad_samples():
    """4 groups of 8 on 3 ranks, micro-batches of 8: rank 1 holds one group and runs 2 micro-batches a step, the
    second a repeat the step weights 0."""
    spec = _spec(3, 1, 8)
    assert spec.micro_parts == [MicroPart(2, 1, 8), MicroPart(2, 1, 0)]
    batches = list(StepBatches(GroupLoader(spec, steps=2, bad_at={0, 1}), spec).epoch(0))
    assert len(batches) == 4
    for step in range(2):
        real, repeat = batches[2 * step], batches[2 * step + 1]
        assert real.ids == _ids(step, (2,), 8) and real.bad == [{"key": f"e0s{step}g2i0"}]
        assert repeat.ids == [] and repeat.bad == []
        assert repeat.images is real.images and repeat.labels is real.labels and repeat.seeds is real.seeds


def test_a_resume_inside_a_step_reads_from_the_steps_first_group():
    spec = _spec(3, 0, 8, groups=8)
    whole = [b.ids for b in StepBatches(GroupLoader(spec, steps=3), spec).epoch(0)]
    for start in range(len(whole)):
        inner = GroupLoader(spec, steps=3)
        assert [b.ids for b in StepBatches(inner, spec).epoch(0, start_batch=start)] == whole[start:]
        assert inner.starts == [start // 2 * 3]  # the step's first group, counted in groups (3 a step)


def test_an_inner_loader_that_ends_early_is_a_data_error_and_closing_closes_it():
    spec = _spec(3, 0, 8, groups=8)
    inner = GroupLoader(spec, steps=3, yields=4)  # a step and a group of the next
    batches = StepBatches(inner, spec).epoch(0)
    assert [len(next(batches).ids) for _ in range(2)] == [8, 4]
    with pytest.raises(DataError, match="the training loader ended in step 1 of epoch 0"):
        next(batches)
    assert inner.closed == 1
    inner = GroupLoader(spec, steps=3)
    batches = StepBatches(inner, spec).epoch(0)
    next(batches)
    batches.close()
    assert inner.closed == 1


@pytest.mark.parametrize("fmt", ["imagefolder", "wds", "ffcv"])
def test_three_ranks_of_four_groups_read_the_one_rank_batches(fmt, fm_tree, fm_wds, fm_ffcv):
    """Micro-batches of one group: 4 a step on 1 rank, 2 on each of 3 (rank 0 holds 2 groups, ranks 1 and 2 one and
    a repeat of it with no ids); the ranks' ids one after the other are the 1-rank step's, also after a resume."""
    path = {"imagefolder": fm_tree, "wds": fm_wds, "ffcv": fm_ffcv}[fmt]
    d = DataConfig(format=fmt, train_path=str(path), val_path=str(path), num_workers=0, repeated_aug=1)

    def steps(world: int, rank: int, start_step: int = 0, count: int = 2) -> list[list]:
        loader = build_loader(d, _spec(world, rank, 8))
        a = loader.spec.accum
        batches = loader.epoch(0, start_batch=start_step * a)
        out = []
        for _ in range(count):
            step = [next(batches) for _ in range(a)]
            assert all(len(b.labels) == 8 for b in step)
            out.append([i for b in step for i in b.ids])
        batches.close()
        return out

    one = steps(1, 0)
    three = [steps(3, r) for r in range(3)]
    assert isinstance(build_loader(d, _spec(3, 1, 8)), StepBatches) and len(build_loader(d, _spec(3, 1, 8))) == \
        len(build_loader(d, _spec(3, 0, 8)))
    assert [len(rank[0]) for rank in three] == [16, 8, 8]
    for s in range(2):
        assert [i for rank in three for i in rank[s]] == one[s]
    assert steps(3, 1, start_step=1, count=1)[0] == three[1][1]  # a resume at step 1
