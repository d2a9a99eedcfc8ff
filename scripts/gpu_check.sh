#!/usr/bin/env bash
# Runs every gpu-marked test in one go on a machine with a CUDA device.
# Wheels placed in .whl/ (for packages the machine lacks) are installed into a private
# target directory first; nothing is fetched from the network.
set -euo pipefail
cd "$(dirname "$0")/.."

PYTHON="${PYTHON:-python3}"
SITE="${GPU_CHECK_SITE:-/tmp/site}"

if compgen -G ".whl/*.whl" > /dev/null; then
    "$PYTHON" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir \
        --upgrade --target "$SITE" .whl/*.whl
    export PYTHONPATH="$SITE${PYTHONPATH:+:$PYTHONPATH}"
fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1

"$PYTHON" - <<'PY'
import inspect
import torch
print("torch", torch.__version__, "cuda available:", torch.cuda.is_available())
try:
    from torch.nn.attention.varlen import varlen_attn
    print("varlen_attn", inspect.signature(varlen_attn))
except ImportError:
    print("varlen_attn: not provided by this torch (per-sequence SDPA fallback)")
PY

"$PYTHON" -m pytest -m gpu tests/ -q -rA --log-level=INFO "$@"
