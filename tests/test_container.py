"""slurm/container/: the Dockerfile and the Apptainer definition agree with the Makefile and pyproject, copy files that
exist, and run an install script whose every step runs here in simulation (no container engine or nvcr.io needed:
apt-get -s, pip --dry-run with the image's torch pinned)."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys

import pytest
from support import REPO

HERE = REPO / "slurm" / "container"
DOCKERFILE = (HERE / "Dockerfile").read_text()
DEF = (HERE / "convit-scale.def").read_text()
INSTALL = (HERE / "install.sh").read_text()


def _apt_packages() -> set[str]:
    (line,) = re.findall(r'^APT_PACKAGES="([^"]+)"', INSTALL, re.M)
    return set(line.split())


def test_the_base_is_ngc_pytorch_and_both_recipes_run_the_install_script():
    assert re.search(r"^FROM nvcr\.io/nvidia/pytorch:\$\{NGC_TAG\}-py3$", DOCKERFILE, re.M)
    (tag,) = re.findall(r"^ARG NGC_TAG=(\S+)$", DOCKERFILE, re.M)
    assert f"From: nvcr.io/nvidia/pytorch:{tag}-py3" in DEF  # the same image either way
    assert "RUN bash slurm/container/install.sh" in DOCKERFILE and "bash slurm/container/install.sh" in DEF


def test_the_apt_packages_are_ffcvs_build_dependencies_from_the_makefile():
    makefile = (REPO / "Makefile").read_text()
    (line,) = re.findall(r"^APT_PACKAGES := (.+)$", makefile, re.M)
    ffcv_deps = {p for p in line.split() if p in ("pkg-config", "libopencv-dev", "libturbojpeg0-dev")}
    assert len(ffcv_deps) == 3, line  # the Makefile still names them
    assert "libopencv-dev, libturbojpeg0-dev and pkg-config" in (REPO / "pyproject.toml").read_text()
    assert _apt_packages() == ffcv_deps | {"libjpeg-dev", "g++"}


def test_the_pip_extra_is_pyprojects_and_torch_is_pinned_to_the_images():
    pyproject = (REPO / "pyproject.toml").read_text()
    assert re.search(r'^ffcv = \["ffcv>=', pyproject, re.M)  # the extra, and FFCV in it
    assert '".[ffcv]"' in INSTALL and '-c "$keep"' in INSTALL
    assert re.search(r'^    "torch>=[\d.]+,<[\d.]+",', pyproject, re.M)  # a range the image's torch can meet


def test_every_file_copied_into_the_image_exists():
    copied = re.findall(r"^COPY (.+) \S+$", DOCKERFILE, re.M)
    copied = [w for line in copied for w in line.split()]
    copied += re.findall(r"^    (\S+) /opt/convit-scale/", DEF, re.M)
    assert {"pyproject.toml", "convit_scale/", "data_prep/", "recipes/"} <= set(copied) | {c + "/" for c in copied}
    for path in copied:
        assert (REPO / path).exists(), path
    # the package's own files: setuptools' package list names nothing outside the copied folders
    block = (REPO / "pyproject.toml").read_text().split("packages = [", 1)[1].split("]", 1)[0]
    tops = {p.split(".")[0] for p in re.findall(r'"([\w.]+)"', block)}
    assert tops <= {c.rstrip("/") for c in copied}, tops  # every package of the wheel is in the image's source


def test_the_install_script_parses_and_its_commands_exist():
    subprocess.run(["bash", "-n", str(HERE / "install.sh")], check=True)
    for command in ("apt-get", "mktemp", "tr"):
        assert shutil.which(command), command


@pytest.mark.slow
def test_the_install_script_runs_in_simulation_and_keeps_torch():
    """apt-get -s resolves the packages from this machine's apt lists; pip --dry-run resolves `.[ffcv]` with torch
    and torchvision pinned to the installed ones, and would install nothing but the project."""
    if not os.path.isdir("/var/lib/apt/lists") or not any(os.scandir("/var/lib/apt/lists")):
        pytest.skip("no apt lists on this machine (apt-get update)")
    env = {**os.environ, "DRY_RUN": "1", "PYTHON": sys.executable, "PIP_NO_INPUT": "1"}
    r = subprocess.run(["bash", str(HERE / "install.sh")], cwd=REPO, env=env, capture_output=True, text=True,
                       timeout=600)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert re.search(r"^keeping: torch==\S+ torchvision==\S+", r.stdout, re.M), r.stdout[:500]
    would = re.findall(r"^Would install (.+)$", r.stdout, re.M)
    assert would and "torch-" not in would[0] and "torchvision-" not in would[0], would


def test_the_site_example_shows_the_container_settings():
    site = (REPO / "slurm" / "site.example.sh").read_text()
    assert "--container-image=" in site and "--container-mounts=" in site and "SRUN_ARGS=" in site
    cluster = (REPO / "docs" / "cluster.md").read_text()
    assert "--container-image=" in cluster and "slurm/container/Dockerfile" in cluster
