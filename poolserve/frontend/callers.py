"""Who a job runs for: an HTTP request (its span, access log line and connection) or a caller
in this process (the Python API). The pipeline accounts a job's work through its caller and
stops waiting when the caller leaves."""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Protocol

from poolserve.observability.tracing import NO_TRACE, RequestTrace
from poolserve.types.tasks import PoolingTask

logger = logging.getLogger(__name__)
# A scope extension of this service's HTTP server: watch(callback) calls callback when the
# request's connection closes and returns what stops watching.
CLOSE_WATCH = "poolserve.close_watch"


class Caller(Protocol):
    """Who a job runs for: how its work is accounted beyond the metrics, and when it leaves."""

    @property
    def trace(self) -> RequestTrace:
        """The caller's trace (the no-op one when nobody traces it)."""

    def routed(self, model_name: str, lora_name: str | None) -> None:
        """The job goes to the model served as `model_name`, through LoRA adapter `lora_name`
        (None: the model as it is)."""

    def tokenized(self, started: float, ended: float, num_inputs: int, num_tokens: int) -> None:
        """The job's tokenization ran from `started` to `ended` (time.monotonic())."""

    def admitted(self, task: PoolingTask, num_tokens: int) -> None:
        """The engine took the job's prompts."""

    def on_leave(self, callback: Callable[[], None]) -> Callable[[], None]:
        """Call `callback` once if the caller goes (never, for one that waits for its answer);
        returns what stops watching."""


class InProcess:
    """A caller in this process (the Python API): nothing to log or trace, never leaves."""

    trace: RequestTrace = NO_TRACE

    def routed(self, model_name: str, lora_name: str | None) -> None:
        """Nothing beyond the metrics."""

    def tokenized(self, started: float, ended: float, num_inputs: int, num_tokens: int) -> None:
        """Nothing beyond the metrics."""

    def admitted(self, task: PoolingTask, num_tokens: int) -> None:
        """Nothing beyond the metrics."""

    def on_leave(self, callback: Callable[[], None]) -> Callable[[], None]:
        """It waits for its answer: cancelling the wait is how it leaves."""
        return _nothing


IN_PROCESS = InProcess()


def _nothing() -> None:
    """Nothing to stop."""
