"""`bench data --stages` and `--calibrate` (convit_scale/bench/stages.py): every format's loader in every mode,
measured against the whole-JPEG decode of the same run, its stages, and the node's decode written where `plan` reads
it. Correctness only: the figures themselves are BENCHMARKS.md's."""

import json

import pytest

from convit_scale.bench.stages import FORMATS, MODES, calibrate, stage_costs


@pytest.fixture(scope="module")
def small(tmp_path_factory):
    from data_prep import PrepOptions, prepare
    from data_prep.fashion_mnist import build_tree

    root = tmp_path_factory.mktemp("stages")
    tree = build_tree(root / "tree", {"train": 13, "val": 2})  # 130 images: 2 batches of 64 an epoch
    paths = {"wds": root / "wds", "ffcv": root / "ffcv"}
    prepare(tree, paths["wds"], PrepOptions(fmt="wds", shard_size=64, workers=1))
    prepare(tree, paths["ffcv"], PrepOptions(fmt="ffcv", workers=1))
    return tree, paths


def test_every_format_and_mode_is_measured_beside_the_decode(small):
    tree, paths = small
    out = stage_costs(tree, paths, seconds=0.0)
    assert out["decode_cpu_ms_per_image"] > 0 and set(out["formats"]) == set(FORMATS)
    for fmt, r in out["formats"].items():
        modes = set(MODES) - ({"decode-on-device"} if fmt == "imagefolder" else set())
        assert set(r["modes"]) == modes and all(v["epochs"] >= 2 and v["vs_decode"] > 0 for v in r["modes"].values())
        ms = {m: v["cpu_ms_per_image"] for m, v in r["modes"].items()}
        # the stages are the differences of the modes: they add up to the cpu mode's whole
        assert sum(x for x in r["stages_ms"].values() if x is not None) == pytest.approx(ms["cpu"])


def test_calibration_is_written_where_plan_reads_it(small, tmp_path, monkeypatch):
    from convit_scale.planner import node_decode_ms

    path = tmp_path / "cal" / "calibration.json"
    monkeypatch.setenv("CONVIT_SCALE_CALIBRATION", str(path))
    assert node_decode_ms()[1] is not None  # none yet: this project's figure, and a warning
    record = calibrate(small[0], 0.2, path)
    assert json.loads(path.read_text())["decode_cpu_ms_per_image"] == record["decode_cpu_ms_per_image"] > 0
    assert node_decode_ms() == (pytest.approx(record["decode_cpu_ms_per_image"]), None)
