"""The WebDataset writer (data_prep/wds_writer.py): shards of nearly equal size, each sample ``KEY.jpg`` (the
source's own bytes) and ``KEY.cls``, shuffled by the seed or in the source's order, finished shards not redone."""

from __future__ import annotations

import collections
import hashlib
import io
import tarfile

from PIL import Image

from convit_scale.imagetree import Sample
from data_prep import PrepOptions, shard_plan
from data_prep.wds_writer import write_wds


def test_shard_plan_differs_by_at_most_one_sample():
    assert shard_plan(10, 5) == [5, 5]
    assert shard_plan(11, 5) == [4, 4, 3]
    assert shard_plan(3, 5) == [3] and shard_plan(0, 5) == [0]
    for n, size in ((1000, 96), (1281167, 1000), (7, 3)):
        plan = shard_plan(n, size)
        assert sum(plan) == n and max(plan) <= size and max(plan) - min(plan) <= 1


def _tree(tmp_path, n: int = 7) -> list[Sample]:
    samples = []
    for i in range(n):
        buf = io.BytesIO()
        Image.new("RGB", (20, 10), (i * 30, 0, 0)).save(buf, format="JPEG")
        (tmp_path / f"{i}.JPEG").write_bytes(buf.getvalue())
        samples.append(Sample(str(tmp_path / f"{i}.JPEG"), i % 3))
    return samples


def _members(path) -> list[tuple[str, bytes]]:
    with tarfile.open(path) as tar:
        return [(m.name, tar.extractfile(m).read()) for m in tar]


def test_shards_hold_each_samples_own_bytes_and_label(tmp_path):
    samples = _tree(tmp_path)
    out = tmp_path / "out"
    out.mkdir()
    files = write_wds(samples, out, "train", PrepOptions(shard_size=3, workers=1), "k", shuffle=False)
    assert list(files) == [f"train-f1-s3-{i:06d}.tar" for i in range(3)]
    assert [rec["samples"] for rec in files.values()] == [3, 2, 2]
    seen = []
    for name, rec in files.items():
        assert rec["sha256"] == hashlib.sha256((out / name).read_bytes()).hexdigest()
        members = _members(out / name)
        keys = sorted({m.split(".")[0] for m, _ in members})
        assert [m for m, _ in members] == [f"{k}.{ext}" for k in keys for ext in ("jpg", "cls")]
        data = dict(members)
        seen += [int(k) for k in keys]
        for k in keys:  # the source file's own bytes, its label
            assert data[f"{k}.jpg"] == (tmp_path / f"{int(k)}.JPEG").read_bytes()
            assert data[f"{k}.cls"] == str(int(k) % 3).encode()
        counts = collections.Counter(int(k) % 3 for k in keys)
        assert rec["per_class"] == {str(c): counts[c] for c in sorted(counts)}
    assert seen == list(range(7))  # shuffle=False: the source's order


def test_shuffled_by_the_seed_and_finished_shards_not_redone(tmp_path):
    samples = _tree(tmp_path)

    def order(out, seed, key="k"):
        out.mkdir(exist_ok=True)
        files = write_wds(samples, out, "train", PrepOptions(shard_size=3, seed=seed, workers=1), key)
        return [int(m.split(".")[0]) for name in files for m, _ in _members(out / name) if m.endswith(".cls")]

    first = order(tmp_path / "a", 0)
    assert sorted(first) == list(range(7)) and first != list(range(7))
    assert order(tmp_path / "b", 0) == first and order(tmp_path / "c", 1) != first
    shards = sorted((tmp_path / "a").glob("*.tar"))
    mtimes = [p.stat().st_mtime_ns for p in shards]
    shards[1].unlink()  # as if interrupted before it was written
    assert order(tmp_path / "a", 0) == first
    assert [p.stat().st_mtime_ns for p in shards if p != shards[1]] == [mtimes[0], mtimes[2]]
    order(tmp_path / "a", 0, key="other")  # another conversion (options or samples): every shard rewritten
    assert [p.stat().st_mtime_ns for p in shards][0] != mtimes[0]
