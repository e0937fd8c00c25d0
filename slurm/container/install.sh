#!/usr/bin/env bash
# Install convit-scale into an NGC PyTorch image (nvcr.io/nvidia/pytorch:<tag>-py3), from the source tree's root.
# Run by Dockerfile and convit-scale.def; tests/test_container.py runs it here with DRY_RUN=1 (apt-get -s, pip
# --dry-run), so that every step but the base image's download is checked without a container engine.
#   PYTHON   the image's Python (default: python)
#   DRY_RUN  1: simulate apt-get and pip, change nothing
set -euo pipefail
PYTHON=${PYTHON:-python}
DRY_RUN=${DRY_RUN:-0}

# FFCV's build dependencies: the Makefile's (pkg-config libopencv-dev libturbojpeg0-dev), libjpeg's headers and a
# C++ compiler (FFCV's extension; DeepSpeed's CPU Adam if ZeRO-Offload is used). The tests check they agree.
APT_PACKAGES="pkg-config libopencv-dev libturbojpeg0-dev libjpeg-dev g++"
if [ "$DRY_RUN" = 1 ]; then
    # shellcheck disable=SC2086
    apt-get install -s -y --no-install-recommends $APT_PACKAGES >/dev/null
else
    apt-get update
    # shellcheck disable=SC2086
    DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends $APT_PACKAGES
    rm -rf /var/lib/apt/lists/*
fi

# Keep the image's CUDA build of torch: pin the versions it has (NGC's are pre-releases with a local tag, e.g.
# 2.7.0a0+79aa17489c, inside pyproject's range), so that pip either keeps them or fails, never replaces them.
keep=$(mktemp)
"$PYTHON" -c 'import importlib.metadata as m; print("\n".join(f"{d}=={m.version(d)}" for d in ("torch", "torchvision")))' >"$keep"
echo "keeping: $(tr '\n' ' ' <"$keep")"

# --no-build-isolation: FFCV and DeepSpeed build against the image's numpy and torch (no second torch downloaded
# into a build environment); DS_BUILD_OPS=0: DeepSpeed's optional ops compile just in time, if ever.
pip_args=(--no-cache-dir --no-build-isolation -c "$keep")
[ "$DRY_RUN" = 1 ] && pip_args+=(--dry-run)
DS_BUILD_OPS=0 "$PYTHON" -m pip install "${pip_args[@]}" ".[ffcv]"

# What the jobs need imports, and torch is the one the image came with.
if [ "$DRY_RUN" != 1 ]; then
    "$PYTHON" - "$keep" <<'PY'
import importlib.metadata as m
import sys

for line in open(sys.argv[1]).read().split():
    name, version = line.split("==")
    assert m.version(name) == version, f"{name} changed: {version} -> {m.version(name)}"
import deepspeed, ffcv, timm, torch, webdataset  # noqa: E401,F401
# From the source tree (the working folder comes first on the path), as a job runs `python -m` from its mounted
# checkout: the package imported is the source's, and the crop-region decoder it loads is the installed copy's.
from convit_scale import jpeg_roi
assert jpeg_roi.AVAILABLE, f"the crop-region JPEG decoder does not load from the source tree: {jpeg_roi.LIBRARY}"
print(f"crop-region decoder: {jpeg_roi.LIBRARY}")
print(f"convit-scale installed; torch {torch.__version__}, CUDA {torch.version.cuda}")
PY
fi
rm -f "$keep"
