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


def test_gpu_tests_probe_their_modules_in_one_interpreter(tmp_path):
    """`make gpu-test` asked a fresh interpreter per module, twice (24 starts, about a minute of the GPU box's time):
    now one interpreter says which packages are missing. Run with a stand-in GPU_PYTHON that counts its starts (the
    CUDA check and pytest answered, the probe run for real)."""
    import os
    import subprocess
    import sys

    from convit_scale.gpu_wheels import missing

    assert missing(["json:json", "no_such_module_xyz:no-such-package"]) == ["no-such-package"]
    starts = tmp_path / "starts"
    fake = tmp_path / "python"
    fake.write_text(f"""#!/bin/bash
echo "$*" >> {starts}
case "$*" in *torch.cuda*|"-m pytest "*) exit 0;; esac
exec {sys.executable} "$@"
""")
    fake.chmod(0o755)
    env = {**os.environ, "GPU_PYTHON": str(fake)}
    # WHEELS of an empty folder: a module missing here fails the test rather than installing from the index
    out = subprocess.run(["make", "-s", "gpu-test", f"GPU_PYTHON={fake}", f"GPU_TEST_OUT={tmp_path}",
                          f"WHEELS={tmp_path}"], cwd=REPO,
                         env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stdout + out.stderr
    lines = starts.read_text().splitlines()
    assert len(lines) == 3 and "--missing" in lines[1], lines
