"""Hooks through which the engine reports events to whoever exports metrics."""

from __future__ import annotations

from typing import Protocol


class EngineObserver(Protocol):
    """Receives one call per event; implementations must be cheap and never raise."""

    def on_step(self, num_tokens: int, duration_s: float) -> None:
        """A step ran num_tokens tokens in duration_s seconds."""

    def on_request_done(self, queue_time_s: float, inference_time_s: float) -> None:
        """A request finished after waiting queue_time_s and running inference_time_s."""

    def on_reject(self, reason: str) -> None:
        """A submission was refused for reason."""


class NullObserver:
    """Observer that ignores everything (offline use, tests)."""

    def on_step(self, num_tokens: int, duration_s: float) -> None:
        """Ignore."""

    def on_request_done(self, queue_time_s: float, inference_time_s: float) -> None:
        """Ignore."""

    def on_reject(self, reason: str) -> None:
        """Ignore."""
