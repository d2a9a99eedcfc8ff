"""Allocator set-up at start: a fixed glibc mmap threshold, so freed buffers leave the process;
the engine core's large buffers on huge pages, or the core on tcmalloc (--core-malloc)."""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import os
import platform
from collections.abc import Mapping

from poolserve.types.process import CoreMalloc

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
# The engine core's forward allocates each activation anew (torch keeps no CPU cache), and under
# the fixed threshold each one above 128 KiB is a fresh mapping faulted in 4 KiB page by page on
# every step. glibc 2.35+ then advises transparent huge pages for mappings of 2 MiB and more
# (where the kernel's THP mode is `madvise`; a no-op under `always` or `never`): a 512th of the
# faults. A MiniLM step of 4,096 tokens, AMX Xeon, 2 threads: float32 601 -> 513 ms, int8 542 ->
# 335 ms (docs/benchmarks.md, "Huge pages for the engine core"). Only the core: its buffers are
# unmapped when freed as before, where the front ends' small ones would round heaps up to 2 MiB.
HUGE_PAGES_TUNABLE = "glibc.malloc.hugetlb=1"


# --core-malloc tcmalloc: gperftools' tcmalloc hands the pages a step frees to the next step's
# buffers, where glibc under the fixed threshold maps and faults each one in again: a MiniLM step
# of 4,096 tokens 270-281 ms against 327-364 ms with huge pages (int8: 138-143 against 217-219),
# int8 on a Qwen3-0.6B geometry 1.9 s against 2.4-3.0 s, the soak's tokens/s 1.26x to 1.45x.
# But the core's resident memory then settles anywhere from 530 MiB to 1 GiB and grew by 20%
# after warm-up in 5 of 8 soak runs, so it is not the default (docs/benchmarks.md, "The engine
# core's allocator"). find_library's names, the build without the heap profiler first.
TCMALLOC_NAMES = ("tcmalloc_minimal", "tcmalloc")
TCMALLOC_PACKAGE = "libtcmalloc-minimal4"  # Debian/Ubuntu's, which the image installs
# gperftools' full build (libtcmalloc.so.4) writes a line with a stack trace to stderr for every
# allocation above 1 GiB; a large model's embedding table is one. Raised out of reach (an
# operator's value wins); the minimal build reports nothing anyway.
TCMALLOC_QUIET = {"TCMALLOC_LARGE_ALLOC_REPORT_THRESHOLD": str(1 << 60)}


def find_tcmalloc() -> str | None:
    """tcmalloc's shared library as the dynamic loader knows it (its soname), or None."""
    for name in TCMALLOC_NAMES:
        found = ctypes.util.find_library(name)
        if found:
            return found
    return None


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


def core_environment(
    environ: Mapping[str, str] = os.environ, malloc: CoreMalloc = "glibc"
) -> tuple[dict[str, str], str]:
    """The engine core's environment, and one line that says which allocator it gets.

    `tcmalloc` preloads tcmalloc. `glibc`: the operator's tunables are kept, the huge-page one
    added unless they name it (a `glibc.malloc.hugetlb=0` of theirs stays); without tunables the
    core gets the fixed threshold too (fix_mmap_threshold would set it, but skips a process whose
    environment sets GLIBC_TUNABLES), unless MALLOC_MMAP_THRESHOLD_ sets one. A preloaded
    allocator of the operator's is left alone, whatever `malloc` says.
    """
    env = dict(environ)
    if "LD_PRELOAD" in env:
        return env, f"the operator's LD_PRELOAD ({env['LD_PRELOAD']})"
    if platform.libc_ver()[0] != "glibc":
        return env, "the C library's own malloc"
    if malloc == "tcmalloc":
        tcmalloc = find_tcmalloc()
        if tcmalloc is None:  # preflight refused this already; a supervisor started by hand
            raise RuntimeError(tcmalloc_missing())
        env["LD_PRELOAD"] = tcmalloc
        for name, value in TCMALLOC_QUIET.items():
            env.setdefault(name, value)
        return env, f"tcmalloc ({tcmalloc})"
    given = env.get("GLIBC_TUNABLES")
    if given is None:
        own = () if "MALLOC_MMAP_THRESHOLD_" in env else (MMAP_TUNABLE,)
        env["GLIBC_TUNABLES"] = ":".join((*own, HUGE_PAGES_TUNABLE))
    elif "glibc.malloc.hugetlb" not in given:
        env["GLIBC_TUNABLES"] = ":".join(part for part in (given, HUGE_PAGES_TUNABLE) if part)
    return env, f"glibc malloc (GLIBC_TUNABLES={env['GLIBC_TUNABLES']})"


def tcmalloc_missing() -> str:
    """The one line that refuses --core-malloc tcmalloc on a system without it."""
    return (
        "--core-malloc tcmalloc: no tcmalloc library on this system "
        f"(Debian/Ubuntu: apt-get install {TCMALLOC_PACKAGE}; or --core-malloc glibc)"
    )


def core_malloc_problem(malloc: CoreMalloc, api_server_count: int) -> str | None:
    """Why --core-malloc cannot be had, in one line (checked before any process starts), or
    None: tcmalloc needs an engine-core process to preload it into, and the library."""
    if malloc != "tcmalloc":
        return None
    if api_server_count == 0:
        return (
            "--core-malloc tcmalloc: --api-server-count 0 runs the engine core in this "
            "process, whose allocator is set before it starts (LD_PRELOAD)"
        )
    return tcmalloc_missing() if find_tcmalloc() is None else None
