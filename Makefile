# Two commands: `make demo` and `make test`. Each installs only what is missing, then runs.
SHELL := /bin/bash
VENV ?= .venv
PY := $(VENV)/bin/python
# The CPU/CUDA build of torch to install when the venv has none; a cluster can point this at its own.
TORCH_PKGS ?= torch==2.14.1 torchvision==0.29.1
# Debian packages: FFCV's build dependencies, the embedded dataset, and the local Slurm cluster of the tests.
APT_PACKAGES := pkg-config libopencv-dev libturbojpeg0-dev dataset-fashion-mnist slurmctld slurmd slurm-client munge
STAMP := $(VENV)/.installed
PYTEST_ARGS ?=
DEMO_ARGS ?=

.PHONY: setup apt-deps test demo clean

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

$(STAMP): pyproject.toml | $(PY)
	@$(PY) -c "import torch" 2>/dev/null || $(PY) -m pip install $(TORCH_PKGS)
	$(PY) -m pip install -e ".[ffcv,test]"
	@$(PY) -c "import ffcv, torch, timm, deepspeed, webdataset" || { echo "error: Python dependencies did not import (see above)"; exit 1; }
	touch $(STAMP)

test: setup
	$(PY) -m pytest $(PYTEST_ARGS)

demo: setup
	$(VENV)/bin/convit-scale demo $(DEMO_ARGS)

clean:
	rm -rf runs/demo .pytest_cache
