"""Allocator set-up at start: a fixed glibc mmap threshold, so freed buffers leave the process;
the engine core apart: its step buffers reused from the heap, on huge pages, trimmed each second."""

from __future__ import annotations

import ctypes
import logging
import os
import platform
import threading
import time
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
MMAP_TUNABLE = f"glibc.malloc.mmap_threshold={MMAP_THRESHOLD_BYTES}"
# The engine core is set up apart. Its forward allocates each activation anew (torch keeps no
# cache of CPU memory), so under the fixed threshold every step-sized tensor is a fresh mapping
# faulted in page by page on every step: a Qwen3-0.6B int8 step of 2,048 tokens took 4.88 s
# against 2.03 s on glibc's dynamic threshold. So the core runs on glibc's dynamic threshold
# (its step buffers reused from the heap), with transparent huge pages advised for regions of
# 2 MiB and more (glibc 2.35+; where the kernel's THP mode is `madvise`), and its heap's free
# pages are handed back every TRIM_INTERVAL_S (malloc_trim), which keeps its memory flat: the
# MiniLM soak at 1.40x the tokens/s of the fixed threshold, RSS +2.2% after warm-up against
# +19.4% untrimmed (docs/benchmarks.md, "The engine core's allocator").
HUGE_PAGES_TUNABLE = "glibc.malloc.hugetlb=1"
TRIM_INTERVAL_S = 1.0


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


def core_environment(environ: Mapping[str, str] = os.environ) -> dict[str, str]:
    """The engine core's environment: `environ` with its glibc tunables for the core.

    The project's own tunable (MMAP_TUNABLE, which the image and `make serve` set for every
    process) or none gives the core glibc's dynamic threshold and huge pages. An operator's other
    tunables are kept, huge pages added unless they name them (a `glibc.malloc.hugetlb=0`
    stays); MALLOC_MMAP_THRESHOLD_ keeps its threshold; a preloaded allocator is left alone.
    """
    env = dict(environ)
    if "LD_PRELOAD" in env or platform.libc_ver()[0] != "glibc":
        return env
    given = env.get("GLIBC_TUNABLES")
    if given is None or given == MMAP_TUNABLE:
        env["GLIBC_TUNABLES"] = HUGE_PAGES_TUNABLE
    elif "glibc.malloc.hugetlb" not in given:
        env["GLIBC_TUNABLES"] = ":".join(part for part in (given, HUGE_PAGES_TUNABLE) if part)
    return env


def trim() -> bool:
    """Hand the heaps' free pages back to the system (glibc's malloc_trim); True if any was."""
    return bool(ctypes.CDLL(None).malloc_trim(0))


def start_trimming(
    environ: Mapping[str, str] = os.environ, interval_s: float = TRIM_INTERVAL_S
) -> bool:
    """In the engine core: trim every `interval_s` on a daemon thread, unless another allocator
    is preloaded or the C library is not glibc; True if started.

    A trim holds each arena's lock while it walks it; the pages it drops are faulted in again
    by the next steps that reuse them, once a second rather than on every step.
    """
    if "LD_PRELOAD" in environ or platform.libc_ver()[0] != "glibc":
        return False

    def run() -> None:
        while True:
            time.sleep(interval_s)
            trim()

    threading.Thread(target=run, name="poolserve-malloc-trim", daemon=True).start()
    return True
