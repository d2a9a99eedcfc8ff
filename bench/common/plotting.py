"""matplotlib for the benchmarks' plots, headless; None when the `bench` extra is missing."""

from __future__ import annotations

import logging
from types import ModuleType

logger = logging.getLogger(__name__)


def pyplot() -> ModuleType | None:
    """matplotlib.pyplot on the Agg backend, or None (with a warning) when not installed."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        logger.warning("matplotlib is not installed (pip install -e '.[bench]'): no plots")
        return None
    return plt
