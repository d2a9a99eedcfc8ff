"""The fastest of a few timed runs, the way the offline benchmarks report a row."""

from __future__ import annotations

import time
from collections.abc import Callable

import numpy as np


def fastest(run: Callable[[], np.ndarray], passes: int) -> tuple[float, np.ndarray]:
    """The fastest of `passes` timed runs (seconds) and its output."""
    best, out = float("inf"), np.empty(0)
    for _ in range(passes):
        start = time.perf_counter()
        out = run()
        best = min(best, time.perf_counter() - start)
    return best, out
