"""A conversion's first phase (data_prep/checks.py): every image read once, the unreadable ones listed with the reason,
for FFCV's ``write_mode: keep`` how each readable one will be stored, and the results cached per split and key."""

from __future__ import annotations

import io
import multiprocessing.connection
import os
import time
from pathlib import Path

import pytest
from PIL import Image

from convit_scale.imagetree import Sample
from data_prep import PrepOptions
from data_prep.checks import KEPT, RAW, RESIZED, check_images, class_counts, worker_pool


def _image(path, size=(40, 30), mode="RGB", fmt="JPEG") -> str:
    buf = io.BytesIO()
    Image.new("RGB", size, (200, 30, 90)).convert(mode).save(buf, format=fmt)
    path.write_bytes(buf.getvalue())
    return str(path)


def _samples(tmp_path) -> list[Sample]:
    tmp_path.joinpath("empty.JPEG").write_bytes(b"")
    tmp_path.joinpath("text.JPEG").write_bytes(b"this is not an image")
    return [Sample(_image(tmp_path / "rgb.JPEG"), 0), Sample(_image(tmp_path / "cmyk.JPEG", mode="CMYK"), 1),
            Sample(_image(tmp_path / "png.JPEG", fmt="PNG"), 1), Sample(_image(tmp_path / "big.JPEG", (90, 20)), 2),
            Sample(str(tmp_path / "empty.JPEG"), 2), Sample(str(tmp_path / "text.JPEG"), 0)]


def test_unreadable_images_are_skipped_with_the_reason_and_the_rest_stored_as_the_writer_will(tmp_path):
    samples = _samples(tmp_path)
    name = {s.path: Path(s.path).name for s in samples}
    out = tmp_path / "out"
    out.mkdir()
    opts = PrepOptions(fmt="ffcv", write_mode="keep", max_resolution=64, workers=1)
    valid, skipped, storage = check_images(samples, out, "train", opts, "k1")
    assert [name[s.path] for s in valid] == ["rgb.JPEG", "cmyk.JPEG", "png.JPEG", "big.JPEG"]
    assert [s.label for s in valid] == [0, 1, 1, 2]
    assert {name[p]: how for p, how in storage.items()} == {"rgb.JPEG": KEPT, "cmyk.JPEG": RAW, "png.JPEG": RAW,
                                                             "big.JPEG": RESIZED}
    reasons = {name[s["path"]]: s["reason"] for s in skipped}
    assert reasons["empty.JPEG"] == "empty file" and reasons["text.JPEG"].startswith("undecodable: ")
    # WebDataset stores every readable image as an RGB JPEG: no storage decision
    wds_valid, wds_skipped, wds_storage = check_images(samples, out, "val", PrepOptions(workers=1), "k1")
    assert wds_valid == valid and [s["path"] for s in wds_skipped] == [s["path"] for s in skipped] and wds_storage == {}


def test_the_check_is_cached_per_split_and_key(tmp_path):
    samples = _samples(tmp_path)
    out = tmp_path / "out"
    out.mkdir()
    opts = PrepOptions(workers=1)
    first = check_images(samples, out, "train", opts, "k1")
    assert (out / ".check-train.json").is_file()
    (tmp_path / "rgb.JPEG").write_bytes(b"")  # not read again under the same key: the cache answers
    assert check_images(samples, out, "train", opts, "k1") == first
    valid, skipped, _ = check_images(samples, out, "train", opts, "k2")  # another key: every image read again
    assert len(valid) == len(first[0]) - 1 and any(s["path"].endswith("rgb.JPEG") for s in skipped)


def test_class_counts_are_by_label_in_label_order():
    assert list(class_counts([10, 2, 2, 0, 10, 10]).items()) == [("0", 1), ("2", 2), ("10", 3)]
    assert class_counts([]) == {}


def test_a_pool_left_by_an_exception_kills_its_workers_instead_of_waiting_for_them():
    """A conversion interrupted (Ctrl-C, a refused sample, a caller's time limit) while a worker hangs ends at once:
    the queued work is cancelled and the workers are killed; ProcessPoolExecutor's own exit would wait for the hung
    task for ever."""
    t0 = time.monotonic()
    with pytest.raises(KeyboardInterrupt):
        with worker_pool(2) as pool:
            futures = [pool.submit(time.sleep, 3600) for _ in range(3)]
            workers = list(pool._processes.values())
            raise KeyboardInterrupt
    assert time.monotonic() - t0 < 20 and len(workers) == 2
    ended, deadline = set(), time.monotonic() + 20  # seen without reaping them: the pool's own thread does
    while (len(ended) < 2 or not all(f.done() for f in futures)) and time.monotonic() < deadline:
        ended.update(multiprocessing.connection.wait([w.sentinel for w in workers], timeout=0.1))
    assert len(ended) == 2 and all(f.done() for f in futures)  # each failed (BrokenProcessPool) or cancelled
    with worker_pool(2) as pool:  # left normally: every task's result
        assert list(pool.map(abs, [-1, -2, 3])) == [1, 2, 3]


def test_the_pool_workers_are_not_forked_from_the_caller():
    """A conversion's workers come from a fork server: a fork of a caller with threads inherits their locks held."""
    with worker_pool(2) as pool:
        parent = pool.submit(os.getppid).result()
    assert parent != os.getpid()
