"""Who a job runs for: an HTTP request (its span, access log line and connection) or a caller
in this process (the Python API). The pipeline accounts a job's work through its caller and
stops waiting when the caller leaves."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import Protocol

from fastapi import Request

from poolserve.observability.logs import MODEL_KEY, PROMPT_TOKENS_KEY
from poolserve.observability.tracing import NO_TRACE, RequestTrace, SpanRecord, trace_of
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

    def routed(self, model_name: str) -> None:
        """The job goes to the model served as `model_name`."""

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

    def routed(self, model_name: str) -> None:
        """Nothing beyond the metrics."""

    def tokenized(self, started: float, ended: float, num_inputs: int, num_tokens: int) -> None:
        """Nothing beyond the metrics."""

    def admitted(self, task: PoolingTask, num_tokens: int) -> None:
        """Nothing beyond the metrics."""

    def on_leave(self, callback: Callable[[], None]) -> Callable[[], None]:
        """It waits for its answer: cancelling the wait is how it leaves."""
        return _nothing


IN_PROCESS = InProcess()


def routed_model(request: Request) -> str:
    """The served name of the model the request was routed to ("" before it was)."""
    name = request.scope.get("state", {}).get(MODEL_KEY)
    return name if isinstance(name, str) else ""


class HTTPCaller:
    """An HTTP request: its span, its access log line, and the connection that may close."""

    def __init__(self, request: Request) -> None:
        self.request = request
        self.trace = trace_of(request)

    def routed(self, model_name: str) -> None:
        """The model in the access log, the request metrics and on the request span."""
        self.request.scope.setdefault("state", {})[MODEL_KEY] = model_name
        self.trace.set({"poolserve.model": model_name})

    def tokenized(self, started: float, ended: float, num_inputs: int, num_tokens: int) -> None:
        """The tokenize span."""
        attributes = {"poolserve.inputs": num_inputs, "poolserve.prompt_tokens": num_tokens}
        self.trace.record(SpanRecord("tokenize", started, ended, attributes))

    def admitted(self, task: PoolingTask, num_tokens: int) -> None:
        """Prompt tokens in the access log and on the request span."""
        scope_state = self.request.scope.setdefault("state", {})
        # a request may submit more than one job (TEI's /predict of texts and pairs): they add up
        total = scope_state.get(PROMPT_TOKENS_KEY, 0) + num_tokens
        scope_state[PROMPT_TOKENS_KEY] = total
        self.trace.set({"poolserve.prompt_tokens": total, "poolserve.task": task.value})

    def on_leave(self, callback: Callable[[], None]) -> Callable[[], None]:
        """Call `callback` when the client closes the connection (the body has been read).

        Under this server the connection says so itself (`CLOSE_WATCH`, no task per request);
        elsewhere a task waits for the ASGI disconnect message.
        """
        watch = self.request.scope.get("extensions", {}).get(CLOSE_WATCH)
        if watch is not None:
            stop: Callable[[], None] = watch(callback)
            return stop
        waiter = asyncio.ensure_future(self._disconnect())
        waiter.add_done_callback(lambda done: None if done.cancelled() else callback())

        def unwatch() -> None:
            waiter.cancel()

        return unwatch

    async def _disconnect(self) -> None:
        while True:
            message = await self.request.receive()
            if message["type"] == "http.disconnect":
                return


def _nothing() -> None:
    """Nothing to stop."""
