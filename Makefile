# One command each: `make test` (install everything, run the suite), `make serve` (install, start the server).
VENV ?= .venv
PY := $(VENV)/bin/python
# CPU build by default (development and CI). PyPI's Linux torch wheels are CUDA builds of several
# GB, pinned or not, so torch alone comes from PyTorch's CPU index (its dependencies then come from
# PyPI with the project's). On a GPU host: make install TORCH_SPEC=torch TORCH_INDEX=
TORCH_SPEC ?= torch==2.13.0
TORCH_INDEX ?= https://download.pytorch.org/whl/cpu
# A fixed mmap threshold keeps the server's memory flat under load (docs/benchmarks.md, "Memory
# under load"); the image sets the same. A GLIBC_TUNABLES of your own wins.
SERVE_GLIBC_TUNABLES := glibc.malloc.mmap_threshold=131072

.PHONY: install test lint serve gpu-check bench soak docker-smoke

install: $(VENV)/.installed

# constraints.txt pins the server's runtime dependencies (the dev tools it does not name stay free).
$(VENV)/.installed: pyproject.toml constraints.txt Makefile
	python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q $(if $(TORCH_INDEX),--no-deps --index-url $(TORCH_INDEX)) "$(TORCH_SPEC)"
	$(PY) -m pip install -q -c constraints.txt -e ".[dev]"
	touch $@

# install-test-tools.sh installs promtool, prometheus and docker-compose from apt when it can
# (root or passwordless sudo); otherwise it says what to install and the tests needing them skip.
test: install
	bash scripts/install-test-tools.sh
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/mypy
	$(PY) -m pytest -q

lint: install
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/mypy

# exec: the server replaces the recipe's shell, so the SIGTERM make forwards to its child reaches
# the server itself (without it the server outlives make and keeps the port). SERVE_ARGS: flags.
serve: install
	HF_HUB_OFFLINE=1 GLIBC_TUNABLES="$${GLIBC_TUNABLES-$(SERVE_GLIBC_TUNABLES)}" \
		exec $(VENV)/bin/poolserve serve $(SERVE_ARGS)

gpu-check:
	bash scripts/gpu_check.sh

# Benchmarks against peers (not tests); results go to docs/benchmarks.md.
bench: install
	$(PY) -m pip install -q -c constraints.txt -e ".[bench]"
	$(PY) -m bench all --quick

# Ten minutes at saturation: server memory, errors and latency drift (docs/benchmarks.md).
soak: install
	$(PY) -m pip install -q -c constraints.txt -e ".[bench]"
	$(PY) -m bench soak

# For maintainers with a Docker engine: build, compose up, one request, Prometheus target up.
docker-smoke:
	bash scripts/docker-smoke.sh
