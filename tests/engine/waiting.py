"""Waiting for a condition another thread or process makes true, in tests of the engine core."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable


async def until(
    condition: Callable[[], bool], timeout_s: float = 10.0, poll_s: float = 0.01
) -> None:
    """Poll `condition` while the caller's event loop keeps running (and sending what it queued)."""
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "condition never held"
        await asyncio.sleep(poll_s)
