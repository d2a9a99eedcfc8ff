"""Allocator set-up at start: a fixed glibc mmap threshold, so freed buffers leave the process."""

from __future__ import annotations

import ctypes
import logging
import os
import platform
from collections.abc import Mapping

logger = logging.getLogger(__name__)

# mallopt's parameter number for the mmap threshold (glibc's malloc.h: M_MMAP_THRESHOLD).
M_MMAP_THRESHOLD = -3
# Buffers from 128 KiB up get their own mapping, unmapped when freed. glibc starts at this
# threshold but raises it (up to 32 MiB) whenever such a buffer is freed; the per-request buffers
# then come from malloc's arenas and stay resident after use (docs/benchmarks.md, "Memory under
# load"). The image and `make serve` set the same value through GLIBC_TUNABLES.
MMAP_THRESHOLD_BYTES = 128 * 1024
# Set by an operator (or by the image): the allocator is configured already, leave it alone.
ALLOCATOR_VARIABLES = ("GLIBC_TUNABLES", "LD_PRELOAD", "MALLOC_MMAP_THRESHOLD_")


def fix_mmap_threshold(environ: Mapping[str, str] = os.environ) -> bool:
    """Fix glibc's mmap threshold unless the environment configures malloc; True if applied."""
    configured = [name for name in ALLOCATOR_VARIABLES if name in environ]
    if configured:
        logger.info("malloc left as configured by %s", ", ".join(configured))
        return False
    if platform.libc_ver()[0] != "glibc":
        return False
    libc = ctypes.CDLL(None)  # the C library this process already runs on
    if libc.mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES) != 1:
        logger.warning("mallopt refused an mmap threshold of %d bytes", MMAP_THRESHOLD_BYTES)
        return False
    logger.info("malloc: mmap threshold fixed at %d bytes", MMAP_THRESHOLD_BYTES)
    return True
