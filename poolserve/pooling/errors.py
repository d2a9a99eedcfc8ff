"""Typed pooling errors; the service maps them to HTTP 400 naming the field."""

from __future__ import annotations

from collections.abc import Iterable


class PoolingError(Exception):
    """Base of every error raised by the pooling package."""


class UnsupportedTaskError(PoolingError):
    """A request asked for a task the model cannot serve."""

    def __init__(self, task: str, supported: Iterable[str]) -> None:
        self.task = task
        self.supported = tuple(sorted(supported))
        names = ", ".join(self.supported) or "none"
        super().__init__(f"task {task!r} is not supported by this model; supported tasks: {names}")


class InvalidPoolingParamsError(PoolingError):
    """A pooling parameter is out of range or makes no sense for the task or model."""

    def __init__(self, param_name: str, message: str) -> None:
        self.param_name = param_name
        self.message = message
        super().__init__(f"{param_name}: {message}")


class PoolingConfigError(PoolingError):
    """The model description handed to pooling is inconsistent (a loader bug, not a request bug)."""


class PoolingStateError(PoolingError):
    """A request pooler was driven out of order: chunk after the last one or close, or empty."""
