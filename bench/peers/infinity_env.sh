#!/usr/bin/env bash
# Creates the Infinity virtual environment for the served benchmarks (idempotent: each step is
# skipped when what it installs is already there).
#
# Usage: bash bench/peers/infinity_env.sh [VENV_DIR]   (default bench/.venvs/infinity, git-ignored)
# torch is installed first and pinned to the project's CPU build, so that resolving
# infinity-emb's extras cannot pull a multi-gigabyte CUDA build. infinity-emb 0.0.78 pins
# sentence-transformers < 4 and numpy < 2, which bring transformers 4.x: this environment
# is separate from the project's for that reason.
set -euo pipefail

VENV_DIR="${1:-$(dirname "$0")/../.venvs/infinity}"
PYTHON="${PYTHON:-python3}"
TORCH_SPEC="${TORCH_SPEC:-torch==2.13.0}"
INFINITY_SPEC="${INFINITY_SPEC:-infinity-emb[server,torch]==0.0.78}"
# Versions this script was checked with; pip may pick others when these are absent.
PINS=(
  "sentence-transformers==3.4.1"
  "transformers==4.57.6"
  "numpy==1.26.4"
)
# Images (`modality: "image"`, CLIP checkpoints: python -m bench images-served). infinity-emb's
# `vision` extra (colpali-engine < 0.4, timm, torchvision, pillow) does not resolve with the pins
# above, and a CLIP checkpoint needs less of it: pillow opens the images, and aiohttp is required
# by its image route even for data URIs. colpali-engine is imported only for ColPali-family
# architectures and timm not at all; torchvision only lets transformers pick its fast image
# processor, which resamples differently from the PIL processor poolserve is checked against.
IMAGE_PINS=(
  "aiohttp==3.14.5"
  "pillow==13.0.0"
)

PIP=("$VENV_DIR/bin/python" -m pip install --disable-pip-version-check -q)
if [[ ! -x "$VENV_DIR/bin/infinity_emb" ]]; then
  mkdir -p "$VENV_DIR"
  # Keeps the environment out of git without touching the repository's .gitignore.
  printf '*\n' > "$(dirname "$VENV_DIR")/.gitignore"
  "$PYTHON" -m venv "$VENV_DIR"
  "${PIP[@]}" "$TORCH_SPEC"
  # The torch line is repeated so that pip keeps the build installed above.
  "${PIP[@]}" "$TORCH_SPEC" "$INFINITY_SPEC" "${PINS[@]}"
fi
if ! "$VENV_DIR/bin/python" -c "import aiohttp, PIL" 2>/dev/null; then
  "${PIP[@]}" "$TORCH_SPEC" "${IMAGE_PINS[@]}"
fi
"$VENV_DIR/bin/python" -c "import torch, infinity_emb, sentence_transformers, transformers, \
aiohttp, PIL; print('torch', torch.__version__, 'infinity_emb', infinity_emb.__version__, \
'sentence_transformers', sentence_transformers.__version__, 'transformers', \
transformers.__version__, 'aiohttp', aiohttp.__version__, 'pillow', PIL.__version__)"
echo "infinity environment ready: $VENV_DIR"
