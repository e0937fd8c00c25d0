"""The loaders behind `build_loader` (convit_scale/data/__init__.py), both formats alike on 2 ranks of 2 workers:
equal batches per rank, every image once per epoch, the same batches and pixels after a resume.

A conversion's tests are in the test_data_prep files, each loader's own in the file named after its module."""

import collections
import json
import os
import subprocess

import pytest
from support import REPO, torchrun_cmd


@pytest.fixture(scope="module")
def two_rank_loaders(fm_wds, fm_ffcv, tmp_path_factory):
    """Both formats' loaders on 2 ranks of 2 workers each, in one launch: {format: (data folder, results folder)}."""
    tmp = tmp_path_factory.mktemp("two_rank_loaders")
    cases = {"wds": (fm_wds, tmp / "wds"), "ffcv": (fm_ffcv, tmp / "ffcv")}
    for _, out in cases.values():
        out.mkdir()
    cmd = torchrun_cmd(2, str(REPO / "tests" / "dist_loader_check.py"), "2", "1",
                       *(f"{fmt}={path}={out}" for fmt, (path, out) in cases.items()))
    res = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert res.returncode == 0, res.stderr[-3000:]
    return cases


@pytest.mark.slow
@pytest.mark.parametrize("fmt", ["wds", "ffcv"])
def test_two_ranks_two_workers_equal_batches_and_coverage(fmt, two_rank_loaders):
    path, out = two_rank_loaders[fmt]
    manifest = json.loads((path / "manifest.json").read_text())
    ranks = [json.loads((out / f"rank{r}.json").read_text()) for r in range(2)]
    for split in ("train", "val"):
        want = collections.Counter({int(k): v for k, v in manifest["splits"][split]["per_class"].items()})
        for epoch in (0, 1):
            key = f"{split}{epoch}"
            assert len(ranks[0][key]["batches"]) == len(ranks[1][key]["batches"]) == ranks[0][key]["len"]
            assert ranks[0][key]["shapes"] == [[3, 32, 32]]
            got = collections.Counter()
            for r in ranks:
                labels = [label for batch in r[key]["batches"] for label in batch][: r[key]["num_real"]]
                got.update(labels)
            if split == "val":
                assert got == want  # exact: every image once, padding not counted
            else:  # 1000 images, batches of 16 on 2 ranks: 496 per rank, 8 dropped in total
                assert sum(got.values()) == 992 and all(want[c] - got[c] >= 0 for c in want)
        if split == "train":  # a new order each epoch
            assert ranks[0]["train0"]["batches"] != ranks[0]["train1"]["batches"]
    for r in ranks:  # resume position: the rest of the epoch is the same batches, the same pixels
        assert r["resumed"] == r["train0"]["batches"][5:]
        assert r["resumed_images"] == r["train0"]["images"][5:]
    assert ranks[0]["train0"]["images"][0] != ranks[1]["train0"]["images"][0]  # each rank its own share
