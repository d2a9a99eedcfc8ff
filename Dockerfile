# syntax=docker/dockerfile:1
# poolserve image. Default: CUDA runtime base with a CUDA build of torch from PyPI.
# CPU-only image: docker build --build-arg VARIANT=cpu -t poolserve:cpu .
# Every server option is a POOLSERVE_* environment variable (see docs/deploy.md).

ARG VARIANT=cuda
ARG CUDA_IMAGE=nvidia/cuda:12.8.1-runtime-ubuntu24.04
ARG CPU_IMAGE=ubuntu:24.04

# One base per variant; both are Ubuntu 24.04 so the builder's virtualenv runs on the runtime's python.
FROM ${CUDA_IMAGE} AS base-cuda
# torch from PyPI: on Linux a CUDA build (it brings its own CUDA libraries).
ENV TORCH_SPEC_DEFAULT=torch \
    TORCH_INDEX_DEFAULT=""

FROM ${CPU_IMAGE} AS base-cpu
# PyPI's Linux torch wheels are CUDA builds of several GB, pinned or not: the CPU build comes from
# PyTorch's own index, as in the Makefile's default.
ENV TORCH_SPEC_DEFAULT=torch==2.13.0 \
    TORCH_INDEX_DEFAULT=https://download.pytorch.org/whl/cpu

# base-${VARIANT} is one of the two stages above, whose images are tagged; hadolint cannot
# resolve the variable.
# hadolint ignore=DL3006
FROM base-${VARIANT} AS base
# Apt versions follow the tagged base image's release: pinned versions would differ per variant
# and break on every point release of the base.
# libtcmalloc-minimal4: the engine core's allocator with --core-malloc tcmalloc (poolserve/memory.py;
# on 24.04 apt picks its 64-bit-time build, libtcmalloc-minimal4t64, which provides the name).
# hadolint ignore=DL3008
RUN apt-get update \
    && apt-get install -y --no-install-recommends python3 ca-certificates libtcmalloc-minimal4 \
    && rm -rf /var/lib/apt/lists/*

FROM base AS builder
# Unpinned apt versions: same reason as above.
# hadolint ignore=DL3008
RUN apt-get update \
    && apt-get install -y --no-install-recommends python3-venv \
    && rm -rf /var/lib/apt/lists/*
RUN python3 -m venv /opt/venv
ENV PATH=/opt/venv/bin:$PATH \
    PIP_DISABLE_PIP_VERSION_CHECK=1
# torch first and in its own layer (as `make install` does): it is large and changes rarely.
# TORCH_SPEC and TORCH_INDEX override the variant's defaults, e.g.
# --build-arg TORCH_SPEC=torch==2.13.0 --build-arg TORCH_INDEX=https://download.pytorch.org/whl/cu128
ARG TORCH_SPEC=""
ARG TORCH_INDEX=""
# The spec comes from a build argument, so hadolint cannot see its pin.
# hadolint ignore=DL3013
RUN index="${TORCH_INDEX:-$TORCH_INDEX_DEFAULT}" \
    && pip install --no-cache-dir ${index:+--index-url "$index"} "${TORCH_SPEC:-$TORCH_SPEC_DEFAULT}"
WORKDIR /src
COPY pyproject.toml README.md constraints.txt ./
COPY poolserve ./poolserve
# Non-editable and without dev extras: the image carries only what the server runs, tracing
# included (--otlp-traces-endpoint; a few MB of OpenTelemetry, imported only when it is set).
# constraints.txt pins every runtime dependency to the version the tests ran with.
# DL3013 asks to pin packages: this is the project itself; constraints.txt pins its dependencies.
# hadolint ignore=DL3013
RUN pip install --no-cache-dir -c constraints.txt ".[tracing]"

FROM base AS runtime
ARG VARIANT
LABEL org.opencontainers.image.title="poolserve" \
      org.opencontainers.image.description="Pooling microservice for language models" \
      org.opencontainers.image.licenses="Apache-2.0" \
      io.poolserve.variant="${VARIANT}"
RUN groupadd --system --gid 10001 poolserve \
    && useradd --system --uid 10001 --gid poolserve --home-dir /data --no-create-home poolserve \
    && mkdir -p /data \
    && chown poolserve:poolserve /data
COPY --from=builder /opt/venv /opt/venv
# GLIBC_TUNABLES: a fixed 128 KiB mmap threshold, so that buffers freed under load go back to
# the system instead of staying in malloc's arenas (docs/benchmarks.md, "Memory under load");
# the supervisor adds huge pages for the engine core alone (poolserve/memory.py).
ENV PATH=/opt/venv/bin:$PATH \
    PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    HF_HOME=/data \
    POOLSERVE_HOST=0.0.0.0 \
    POOLSERVE_PORT=8000 \
    GLIBC_TUNABLES=glibc.malloc.mmap_threshold=131072
# The model cache (Hub downloads) lives in a volume so it survives container replacement.
VOLUME ["/data"]
WORKDIR /data
USER 10001:10001
EXPOSE 8000
# Liveness only: /health answers while the model loads; readiness is /ready (see docs/deploy.md).
HEALTHCHECK --interval=15s --timeout=5s --start-period=60s --retries=3 \
    CMD ["python3", "-c", "import os, urllib.request; urllib.request.urlopen('http://127.0.0.1:' + os.environ.get('POOLSERVE_PORT', '8000') + '/health', timeout=4)"]
# SIGTERM starts the graceful drain; the server exits within --shutdown-timeout + about 2 s, which
# `docker stop --time` / Compose's stop_grace_period must exceed.
STOPSIGNAL SIGTERM
# Exec form: poolserve is PID 1 and receives SIGTERM directly, which starts its graceful drain.
ENTRYPOINT ["poolserve", "serve"]
