"""How the server's processes find and tell each other: socket paths and signals."""

from __future__ import annotations

import os
import signal
from typing import Literal

# What the process supervisor sends a front end when the engine core process has exited.
CORE_LOST_SIGNAL = signal.SIGUSR1


def socket_path(directory: str, index: int) -> str:
    """Where model `index` (in the served models' order) of the engine core listens."""
    return os.path.join(directory, f"engine-core-{index}.sock")


# prometheus-client's switch to multiprocess mode: the folder every process writes its metrics to
MULTIPROCESS_DIR = "PROMETHEUS_MULTIPROC_DIR"

# --core-malloc: the engine-core process's allocator (poolserve/memory.py sets it up)
CoreMalloc = Literal["glibc", "tcmalloc"]
