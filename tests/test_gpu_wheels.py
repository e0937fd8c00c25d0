"""convit_scale/gpu_wheels.py, offline: the resolution check of `make gpu-wheels` (its download and DeepSpeed's build
need the network and run in `make gpu-wheels` alone), on a folder of stand-in wheels."""

from __future__ import annotations

import pytest
from support import REPO

from convit_scale.gpu_wheels import BUDGET, BUILT, DOWNLOADED, check, pins, stub_wheel, tree_bytes

FOLDER = {"deepspeed": ("torch>=2.0.0", "pydantic>=1.0", "msgpack"), "pydantic": (), "msgpack": (),
          "webdataset": ("numpy", "pyyaml", "braceexpand"), "braceexpand": (), "pytest-timeout": ("pytest>=7.0.0",)}


def test_the_folder_resolves_with_the_boxs_own_packages_and_a_missing_one_is_named(tmp_path):
    for name, requires in FOLDER.items():
        stub_wheel(tmp_path, name, "1.0", requires)
    resolved = check(tmp_path)
    assert {r.rpartition("-")[0] for r in resolved} >= {"deepspeed", "webdataset", "pytest-timeout", "braceexpand",
                                                         "torch", "numpy", "pytest"}
    (tmp_path / "braceexpand-1.0-py3-none-any.whl").unlink()
    with pytest.raises(RuntimeError, match="do not resolve for Python 3.12: .*braceexpand"):
        check(tmp_path)


def test_the_folder_holds_the_versions_tested_here_and_fits_beside_the_tree():
    pinned = pins()
    assert set(pinned) == {*BUILT, *DOWNLOADED} and all(pinned.values())
    assert tree_bytes(REPO) < BUDGET / 2  # room for the wheels (about 6 MiB)
