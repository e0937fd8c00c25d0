"""The batch every loader yields (convit_scale/data/batch.py): unpacks as (x, y), and keeps its seeds, replaced
samples and ids through a DataLoader worker (pickled) and through pinning."""

from __future__ import annotations

import pytest
import torch
from torch.utils.data import DataLoader

from convit_scale.data.batch import Batch


def _batch(index: int) -> Batch:
    return Batch(torch.full((2, 3, 4, 4), float(index)), torch.tensor([index, index + 1]),
                 seeds=torch.tensor([10 * index, 10 * index + 1]), bad=[{"file": f"f{index}", "reason": "truncated"}],
                 ids=[f"s/{index}", f"s/{index + 1}"])


class _Batches(torch.utils.data.Dataset):
    def __len__(self):
        return 2

    def __getitem__(self, index):
        return _batch(index)


def _same(a: Batch, b: Batch) -> bool:
    return (torch.equal(a.images, b.images) and torch.equal(a.labels, b.labels) and torch.equal(a.seeds, b.seeds)
            and a.bad == b.bad and a.ids == b.ids)


def test_unpacks_as_images_and_labels():
    x, y = _batch(3)
    assert torch.equal(x, _batch(3).images) and y.tolist() == [3, 4]


def test_a_batch_made_in_a_worker_process_arrives_whole():
    loader = DataLoader(_Batches(), batch_size=None, num_workers=1, collate_fn=lambda b: b)
    got = list(loader)
    assert all(isinstance(b, Batch) for b in got) and all(_same(b, _batch(i)) for i, b in enumerate(got))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="pinned memory needs CUDA")
def test_pinning_keeps_everything():
    pinned = _batch(1).pin_memory()
    assert pinned.images.is_pinned() and pinned.labels.is_pinned() and pinned.seeds.is_pinned()
    assert _same(pinned, _batch(1))
    assert Batch(torch.zeros(1, 3, 2, 2), torch.zeros(1)).pin_memory().seeds is None


@pytest.mark.skipif(not torch.cuda.is_available(), reason="pinned memory needs CUDA")
def test_a_step_is_joined_straight_into_page_locked_memory():
    from convit_scale.data.batch import Boxes, Encoded, cat_images

    parts = [torch.arange(24, dtype=torch.uint8).view(2, 3, 2, 2), torch.zeros(1, 3, 2, 2, dtype=torch.uint8)]
    joined = cat_images(parts, pin=True)
    assert joined.is_pinned() and torch.equal(joined, torch.cat(parts))
    boxes = Boxes.cat([Boxes(torch.arange(12, dtype=torch.uint8), torch.tensor([[2, 2]]), torch.tensor([True]))] * 2,
                      pin=True)
    assert boxes.pixels.is_pinned() and boxes.sizes.is_pinned() and boxes.flips.is_pinned()
    encoded = Encoded.cat([Encoded(torch.arange(5, dtype=torch.uint8), torch.ones(1, 8, dtype=torch.long),
                                   torch.tensor([False]))] * 2, pin=True)
    assert not encoded.data.is_pinned() and encoded.flips.is_pinned()  # the payloads are read on the host
