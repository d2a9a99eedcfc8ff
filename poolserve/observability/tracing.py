"""Request tracing: the switch, a no-op trace when off, and the spans engine timelines make.

OpenTelemetry itself is imported only by `service/otel.py`, and only when
--otlp-traces-endpoint is set: without it nothing here costs more than a method call.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

from poolserve.types.outputs import PoolingOutput, RequestTimeline, StepTiming

if TYPE_CHECKING:  # annotations only: the Python API runs the front end without Starlette
    from starlette.requests import Request
    from starlette.types import Scope

AttributeValue = str | int | float | bool
Attributes = Mapping[str, AttributeValue]
# Where a request's trace lives in its ASGI scope's state, for the routes to find.
TRACE_KEY = "poolserve_trace"
EXTRA_HINT = "pip install 'poolserve[tracing]'"
# The request span's attribute naming the LoRA adapter a request ran through (set only then):
# OpenTelemetry's gen_ai conventions and vLLM's spans name no adapter, so it is this server's.
LORA_SPAN_ATTRIBUTE = "poolserve.lora_name"


class TracingUnavailableError(RuntimeError):
    """--otlp-traces-endpoint was given but the OpenTelemetry packages are not installed."""


@dataclass(frozen=True)
class SpanRecord:
    """A finished span to be exported: name, time.monotonic() instants, attributes."""

    name: str
    start: float
    end: float
    attributes: Attributes


class RequestTrace(Protocol):
    """The spans of one HTTP request; every method is cheap and never raises."""

    @property
    def trace_id(self) -> str | None:
        """The trace's id in hex, None when the request is not traced."""

    def record(self, span: SpanRecord) -> None:
        """Add a finished child span of the request's span."""

    def add_outputs(self, outputs: Iterable[PoolingOutput]) -> None:
        """Keep the outputs' engine timelines: their queue and step spans are made at the end."""

    def set(self, attributes: Attributes) -> None:
        """Set attributes on the request's span."""

    def finish(self, route: str | None, status: int, end: float) -> None:
        """End the request's span (and its engine spans) with the response status."""


class Tracing(Protocol):
    """Starts a trace per HTTP request; flushes what is left at shutdown."""

    def start(
        self, scope: Scope, headers: Mapping[str, str], start: float, request_id: str
    ) -> RequestTrace:
        """A trace for this request, a child of the caller's `traceparent` if it sent one."""

    def shutdown(self) -> None:
        """Export what is buffered, within a bounded time."""


class NullTrace:
    """What an untraced request carries: every method does nothing."""

    trace_id: str | None = None

    def record(self, span: SpanRecord) -> None:
        """Ignore."""

    def add_outputs(self, outputs: Iterable[PoolingOutput]) -> None:
        """Ignore."""

    def set(self, attributes: Attributes) -> None:
        """Ignore."""

    def finish(self, route: str | None, status: int, end: float) -> None:
        """Ignore."""


class NullTracing:
    """Tracing off."""

    def start(
        self, scope: Scope, headers: Mapping[str, str], start: float, request_id: str
    ) -> RequestTrace:
        """The shared no-op trace."""
        return NO_TRACE

    def shutdown(self) -> None:
        """Nothing to flush."""


NO_TRACE = NullTrace()
NO_TRACING = NullTracing()


def build_tracing(endpoint: str | None) -> Tracing:
    """OTLP/HTTP tracing to endpoint, or none; a clear error when the packages are missing."""
    if endpoint is None:
        return NO_TRACING
    return require_tracing()(endpoint)


def require_tracing() -> Callable[[str], Tracing]:
    """What builds tracing to an endpoint; TracingUnavailableError without the packages."""
    try:
        from poolserve.observability.otel import OTelTracing  # imported only with the flag
    except ImportError as exc:
        raise TracingUnavailableError(
            f"--otlp-traces-endpoint needs the OpenTelemetry SDK and its OTLP/HTTP exporter "
            f"({exc.name or exc} is not installed): {EXTRA_HINT}"
        ) from None
    return OTelTracing


def trace_of(request: Request) -> RequestTrace:
    """The trace the edge started for this request (the no-op one outside the edge)."""
    trace: RequestTrace = request.scope.get("state", {}).get(TRACE_KEY, NO_TRACE)
    return trace


def engine_spans(timelines: Sequence[RequestTimeline]) -> list[SpanRecord]:
    """A queue span (arrival until every input had started), then one span per engine step.

    A step that ran several inputs of the request is one span: its attributes count the
    request's own tokens and chunks in it next to the whole step's.
    """
    if not timelines:
        return []
    queue = SpanRecord(
        "queue",
        min(t.arrival_time for t in timelines),
        max(t.first_scheduled_time for t in timelines),
        {"poolserve.inputs": len(timelines)},
    )
    by_step: dict[int, list[StepTiming]] = {}
    for timeline in timelines:
        for step in timeline.steps:
            by_step.setdefault(step.step_index, []).append(step)
    steps = [_step_span(index, chunks) for index, chunks in sorted(by_step.items())]
    return [queue, *steps]


def _step_span(index: int, chunks: Sequence[StepTiming]) -> SpanRecord:
    """One step, as the request's chunks in it saw it (they share its times and sizes)."""
    first = chunks[0]
    return SpanRecord(
        "engine.step",
        first.started_at,
        first.started_at + first.duration_s,
        {
            "poolserve.step.index": index,
            "poolserve.step.tokens": first.num_step_tokens,
            "poolserve.step.seqs": first.num_step_seqs,
            "poolserve.request.tokens": sum(c.num_tokens for c in chunks),
            "poolserve.request.chunks": len(chunks),
        },
    )
