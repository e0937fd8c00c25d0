# Two commands: `make demo` and `make test` (and `make rehearsal`). Each installs only what is missing, then runs.
SHELL := /bin/bash
VENV ?= .venv
PY := $(VENV)/bin/python
# The CPU/CUDA build of torch to install when the venv has none; a cluster can point this at its own.
TORCH_PKGS ?= torch==2.14.1 torchvision==0.29.1
# Debian packages: FFCV's build dependencies, libjpeg's headers (convit_scale/_jpeg_roi.c), the embedded dataset, and
# the local Slurm cluster of the tests.
APT_PACKAGES := pkg-config libopencv-dev libturbojpeg0-dev libjpeg-dev dataset-fashion-mnist slurmctld slurmd slurm-client munge
STAMP := $(VENV)/.installed
PYTEST_ARGS ?=
# Test files run on this many pytest-xdist workers (a file per worker at a time); 0 runs them in this process.
TEST_JOBS ?= 2
DEMO_ARGS ?=

.PHONY: dryrun-ext setup apt-deps cpu-adam test rehearsal demo gpu-test gpu-wheels deepspeed-floor clean

setup: apt-deps $(STAMP)

# policy-rc.d keeps the package scripts from starting slurmctld/slurmd/munge as system services.
apt-deps:
	@missing=""; for p in $(APT_PACKAGES); do dpkg-query -W -f='$${Status}' $$p 2>/dev/null | grep -q "ok installed" || missing="$$missing $$p"; done; \
	if [ -z "$$missing" ]; then exit 0; fi; \
	echo "Installing Debian packages:$$missing"; \
	if [ "$$(id -u)" = 0 ]; then SUDO=""; elif sudo -n true 2>/dev/null; then SUDO="sudo"; else \
	  echo "error: missing Debian packages and no root. Ask an administrator to run:"; \
	  echo "  apt-get install -y --no-install-recommends$$missing"; exit 1; fi; \
	printf '#!/bin/sh\nexit 101\n' | $$SUDO tee /usr/sbin/policy-rc.d >/dev/null; $$SUDO chmod +x /usr/sbin/policy-rc.d; \
	( $$SUDO apt-get update -q && DEBIAN_FRONTEND=noninteractive $$SUDO apt-get install -y -q --no-install-recommends $$missing ); rc=$$?; \
	$$SUDO rm -f /usr/sbin/policy-rc.d; exit $$rc

$(PY):
	python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip

# The C source too: pip install -e . compiles convit_scale/_jpeg_roi.c (the crop-region JPEG decoder) in place.
$(STAMP): pyproject.toml convit_scale/_jpeg_roi.c | $(PY)
	@$(PY) -c "import torch" 2>/dev/null || $(PY) -m pip install $(TORCH_PKGS)
	$(PY) -m pip install -e ".[ffcv,test]"
	@$(PY) -c "import ffcv, torch, timm, deepspeed, webdataset, xdist" && [ -x $(VENV)/bin/ruff ] || { echo "error: Python dependencies did not import (see above)"; exit 1; }
	@$(PY) -c "from convit_scale import jpeg_roi; jpeg_roi.AVAILABLE or print('warning:', jpeg_roi.LIBRARY)"
	touch $(STAMP)

# DeepSpeed's CPU Adam (the optimizer of ZeRO offload) is a C++ extension that DeepSpeed compiles on first use into
# torch's extension cache (~/.cache/torch_extensions/py311_cpu-torch<release>-<environment>-cpu<kind>: extensions.py; up to date: a
# few seconds). Compiled here, alone, it takes about
# 90 s on 2 cores; compiled by the first offload test, about 4.5 min, competing with the tests of the other worker.
cpu-adam: setup
	@$(PY) -c "from convit_scale.parallel.zero_engine import build_cpu_adam; build_cpu_adam()" >/dev/null || { \
	  echo "error: DeepSpeed's CPU Adam did not build (it needs a C++ compiler: apt-get install g++)"; exit 1; }

# plan --dry-run's driverless CUDA extension (convit_scale/dryrun/native.py) compiles on first use into
# ~/.cache/convit-scale, one build per environment (up to date: a second); built here, alone, before the tests that use it. Nothing to build
# where the installed torch cannot simulate GPUs (those tests say why and are skipped).
dryrun-ext: setup
	@$(PY) -c "from convit_scale.dryrun.native import simulation_problem, load; simulation_problem() or load()" || { \
	  echo "error: the dry run's driverless CUDA extension did not build (it needs a C++ compiler: apt-get install g++)"; exit 1; }

test: setup cpu-adam dryrun-ext
	$(VENV)/bin/ruff check .
	$(PY) -m pytest $(if $(filter-out 0,$(TEST_JOBS)),-n $(TEST_JOBS) --dist loadfile) $(PYTEST_ARGS)

# The 4 x 8 rehearsal (convit_scale/rehearsal/run.py): slurm/convit_b_plus.sh's job shape, 32 ranks on a local Slurm cluster of 4
# nodes of 8 CPUs on this machine, interrupted by the pre-timeout signal, requeued onto 3 of its 4 nodes (one drained)
# and compared with an uninterrupted run; goodput figures printed and written to runs/rehearsal/rehearsal.json.
# About 10-11 minutes on 2 idle cores (three starts of 32 interpreters) and 14 GB of memory: not part of `make test`.
# REHEARSAL_ARGS: e.g. "--script slurm/deit_b_plus.sh", "--requeue-nodes 4" or "parallel.hsdp_replicas=1".
REHEARSAL_ARGS ?=
# REHEARSAL_ARGS="--fault all" (or kill, stop, worker, node): unplanned failures instead (docs/failures.md).
rehearsal: setup
	$(PY) -m convit_scale.rehearsal $(REHEARSAL_ARGS)

# GPU acceptance (tests/test_gpu.py, docs/gpu.md): in groups, each one command of at most 8 minutes on one H200, the
# first (GROUP=1, the default) the most telling; GROUP=all runs them all. It uses the Python that already has the CUDA
# build of torch (GPU_PYTHON) and the checkout itself (PYTHONPATH). What that Python lacks is installed into GPU_SITE
# (a folder beside the checkout, first on PYTHONPATH): from the wheels of `make gpu-wheels` in WHEELS when given (a box
# without network; --no-deps: the folder is the closure), else from the package index. FFCV checks are skipped with
# the reason where FFCV is not installed. Each group writes GPU_TEST_OUT/group<N>.json (its tests, outcomes, seconds,
# the machine) beside the JSON its tests write, for BENCHMARKS.md.
GPU_PYTHON ?= python3
WHEELS ?=
GROUP ?= 1
GPU_TEST_OUT ?= runs/gpu-test
GPU_SITE ?= .gpu-site
GPU_MODULES := deepspeed:deepspeed webdataset:webdataset timm:timm safetensors:safetensors rich:rich yaml:pyyaml \
	matplotlib:matplotlib accelerate:accelerate psutil:psutil pytest:pytest pytest_timeout:pytest-timeout PIL:pillow
GPU_MARK = $(if $(filter all,$(GROUP)),gpu,gpu and g$(GROUP))
GPU_ENV = PYTHONPATH=$(abspath $(GPU_SITE)):$(CURDIR):$(CURDIR)/tests
gpu-test:
	@$(GPU_PYTHON) -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)" || { \
	  echo "error: $(GPU_PYTHON) sees no CUDA device (torch.cuda.is_available() is False); set GPU_PYTHON to the Python with the CUDA torch"; exit 1; }
	@missing=$$($(GPU_ENV) $(GPU_PYTHON) -m convit_scale.gpu_wheels --missing $(GPU_MODULES) 2>/dev/null) || exit 1; \
	if [ -n "$$missing" ]; then echo "Installing into $(GPU_SITE): $$missing"; \
	  if [ -n "$(WHEELS)" ]; then $(GPU_PYTHON) -m pip install -q --no-index --no-deps --target $(GPU_SITE) $(WHEELS)/*.whl; \
	  else $(GPU_PYTHON) -m pip install -q $$missing; fi || { echo "error: could not install$$missing (make gpu-wheels builds their folder: pass WHEELS=that/folder)"; exit 1; }; \
	  still=$$($(GPU_ENV) $(GPU_PYTHON) -m convit_scale.gpu_wheels --missing $(GPU_MODULES)) || exit 1; \
	  if [ -n "$$still" ]; then echo "error: $$still does not import after the install (WHEELS=$(WHEELS) lacks it?)"; \
	    exit 1; fi; fi
	GPU_TEST_GROUP=$(GROUP) GPU_TEST_OUT=$(abspath $(GPU_TEST_OUT)) $(GPU_ENV) $(GPU_PYTHON) -m pytest -m "$(GPU_MARK)" \
	  -p gpu_report tests/test_gpu.py -v -rs -p no:cacheprovider $(PYTEST_ARGS)

# The wheels the GPU box lacks (Python 3.12, manylinux x86_64): DeepSpeed built here as a pure-Python wheel, its
# dependencies and WebDataset's (pydantic-core and msgpack compiled, cp312), pytest-timeout; checked to resolve from
# the folder alone (--no-index, the box's own torch, numpy, pyyaml and pytest standing in), sizes printed (the folder
# travels with the working tree: 64 MiB at most). Needs the package index (convit_scale/gpu_wheels.py).
GPU_WHEELS ?= build/gpu-wheels
gpu-wheels: setup
	$(PY) -m convit_scale.gpu_wheels $(GPU_WHEELS)

# The oldest DeepSpeed pyproject.toml admits, beside the installed one: the tests whose outcome depends on its release
# (a bad step under ZeRO-1/2/3 with DeepSpeed's own checks of that era, the GPU DeepSpeed takes and the LOCAL_RANK it
# reads, its bf16 switch, the best weights from its fp32 partitions, the universal checkpoint of a ZeRO-2 run resumed
# on another world size; ZeRO-3's conversion needs DeepSpeed >= 0.19 and is refused below it) run against it. Built
# here from its source as a pure wheel (no build isolation: the venv's torch), installed beside the venv. Not part of
# `make test`.
DEEPSPEED_FLOOR ?= 0.16.0
FLOOR_DIR := $(VENV)/deepspeed-$(DEEPSPEED_FLOOR)
deepspeed-floor: setup
	@[ -d $(FLOOR_DIR) ] || { DS_BUILD_OPS=0 $(PY) -m pip wheel -q --no-deps --no-build-isolation -w $(FLOOR_DIR).wheel deepspeed==$(DEEPSPEED_FLOOR) && \
	  $(PY) -m pip install -q --no-deps --target $(FLOOR_DIR) $(FLOOR_DIR).wheel/deepspeed-$(DEEPSPEED_FLOOR)-*.whl; }
	PYTHONPATH=$(abspath $(FLOOR_DIR)):$(CURDIR) $(PY) -m pytest -p no:cacheprovider tests/test_parallel_nonfinite.py \
	  tests/test_parallel_zero.py tests/test_parallel_zero_engine.py tests/test_parallel_zero_config.py \
	  tests/test_parallel_universal.py tests/test_train_elastic.py -k "zero or deepspeed or universal" $(PYTEST_ARGS)

demo: setup
	$(VENV)/bin/convit-scale demo $(DEMO_ARGS)

clean:
	rm -rf runs/demo runs/rehearsal .pytest_cache
