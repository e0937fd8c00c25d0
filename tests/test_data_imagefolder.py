"""The ImageFolder loader (convit_scale/data/imagefolder.py): unreadable files replaced by the next readable one,
listed and counted; each view's transform seeded by its position in the epoch, so an epoch and its resume give the
same pixels."""

import pytest
import torch
from support import epoch_batches

from convit_scale.config import DataConfig
from convit_scale.data import DataError, LoaderSpec, build_loader


def test_imagefolder_unreadable_files_are_replaced_counted_and_limited(tmp_path):
    from data_prep.fashion_mnist import build_tree

    root = build_tree(tmp_path / "tree", {"train": 5, "val": 1})
    files = sorted((root / "train").rglob("*.JPEG"))
    files[3].write_bytes(b"not an image")
    files[7].write_bytes(files[7].read_bytes()[:100])  # truncated
    d = DataConfig(format="imagefolder", train_path=str(root), val_path=str(root), num_workers=0, repeated_aug=1)
    loader = build_loader(d, LoaderSpec("train", 32, 10))
    first = epoch_batches(loader)
    bad = [r for _, _, rs in first for r in rs]
    assert sorted(r["file"] for r in bad) == sorted(str(f) for f in (files[3], files[7]))
    assert all(r["reason"].startswith("unreadable image") and r["key"] == r["file"].rsplit("/", 1)[1].rsplit(".", 1)[0]
               for r in bad)
    again = epoch_batches(loader)
    assert all(torch.equal(x0, x1) and torch.equal(y0, y1) and b0 == b1
               for (x0, y0, b0), (x1, y1, b1) in zip(first, again))
    strict = build_loader(DataConfig(**{**d.__dict__, "max_bad_samples": 1}), LoaderSpec("train", 32, 10))
    with pytest.raises(DataError, match=r"data.max_bad_samples = 1") as e:
        epoch_batches(strict)
    assert str(e.value).split(":")[0] in {str(files[3]), str(files[7])}


def test_a_resumed_epoch_gives_the_same_batches_and_each_batch_its_views_seeds_and_ids(fm_tree):
    d = DataConfig(format="imagefolder", train_path=str(fm_tree), val_path=str(fm_tree), num_workers=0,
                   repeated_aug=1, subset_fraction=0.1)  # 10 images per class
    loader = build_loader(d, LoaderSpec("train", 32, 16, seed=3))
    assert loader.num_samples == 100 and len(loader) == 100 // 16
    batches = list(loader.epoch(0))
    assert all(len(b.seeds) == len(b.labels) == len(b.ids) == 16 for b in batches)
    ids = [i for b in batches for i in b.ids]
    assert len(set(ids)) == len(ids) and {loader.samples[i][1] for i in ids} <= set(range(10))
    assert all(b.labels.tolist() == [loader.samples[i][1] for i in b.ids] for b in batches)  # ids are the samples
    resumed = epoch_batches(loader, 0, start_batch=2)
    assert all(torch.equal(x, b.images) and torch.equal(y, b.labels) for (x, y, _), b in zip(resumed, batches[2:]))
    assert len(resumed) == len(batches) - 2
    assert not torch.equal(epoch_batches(loader, 1)[0][0], batches[0].images)  # another epoch, another order and crops


def test_an_unreadable_training_file_takes_the_next_view_of_its_canonical_group(tmp_path):
    """Groups of 5 views: the view of an unreadable file takes the next readable view of its own group (the last view
    of a group: the group's first), with that view's label and its own seed's crop."""
    from data_prep.fashion_mnist import build_tree

    root = build_tree(tmp_path / "tree", {"train": 3, "val": 1})
    d = DataConfig(format="imagefolder", train_path=str(root), val_path=str(root), num_workers=0, repeated_aug=1)
    spec = LoaderSpec("train", 28, 10, global_batch_size=10, canonical_groups=2)
    clean = next(iter(build_loader(d, spec).epoch(0)))
    loader = build_loader(d, spec)
    broken = [4, 6]  # the last view of group 0, the second of group 1
    for i in broken:
        with open(loader.samples[clean.ids[i]][0], "wb") as f:
            f.write(b"not an image")
    batch = next(iter(loader.epoch(0)))
    assert batch.ids == clean.ids and [r["reason"].split(" (")[0] for r in batch.bad] == ["unreadable image"] * 2
    want = clean.labels.clone()
    want[4], want[6] = clean.labels[0], clean.labels[7]
    assert torch.equal(batch.labels, want)
    assert not torch.equal(batch.images[4], clean.images[0])  # the replacement's file, cropped with view 4's seed
    assert torch.equal(batch.images[5], clean.images[5])
