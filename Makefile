# One command each: `make test` (install everything, run the suite), `make serve` (install, start the server).
VENV ?= .venv
PY := $(VENV)/bin/python
# CPU build by default (development and CI). On a GPU host: make install TORCH_SPEC=torch
TORCH_SPEC ?= torch==2.13.0

.PHONY: install test lint serve gpu-check bench docker-smoke

install: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml Makefile
	python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q "$(TORCH_SPEC)"
	$(PY) -m pip install -q -e ".[dev]"
	touch $@

test: install
	bash scripts/install-test-tools.sh
	$(VENV)/bin/ruff check .
	$(VENV)/bin/mypy
	$(PY) -m pytest -q

lint: install
	$(VENV)/bin/ruff check .
	$(VENV)/bin/mypy

serve: install
	HF_HUB_OFFLINE=1 $(VENV)/bin/poolserve serve

gpu-check:
	bash scripts/gpu_check.sh

# Benchmarks against peers (not tests); results go to docs/benchmarks.md.
bench: install
	$(PY) -m pip install -q -e ".[bench]"
	$(PY) -m bench all --quick

# For maintainers with a Docker engine: build, compose up, one request, Prometheus target up.
docker-smoke:
	bash scripts/docker-smoke.sh
