"""OpenTelemetry tracing over OTLP/HTTP: one server span per request, its children from records.

Imported only when --otlp-traces-endpoint is set (the `tracing` extra). Every span gets
explicit times from one monotonic clock, so children always sit inside their parent.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterable, Mapping
from urllib.parse import urlsplit

from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
from opentelemetry.sdk.resources import SERVICE_NAME, Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, SpanExporter
from opentelemetry.trace import Span, SpanKind, Status, StatusCode, format_trace_id
from opentelemetry.trace.propagation import set_span_in_context
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator
from starlette.types import Scope

from poolserve.observability.tracing import (
    NO_TRACE,
    Attributes,
    RequestTrace,
    SpanRecord,
    engine_spans,
)
from poolserve.types.errors import clip
from poolserve.types.outputs import PoolingOutput, RequestTimeline

TRACES_PATH = "/v1/traces"
# At shutdown, buffered spans get this long to leave; an unreachable collector cannot hold
# the exit past it.
SHUTDOWN_TIMEOUT_S = 3.0


def traces_url(endpoint: str) -> str:
    """The OTLP/HTTP traces URL: as given, or with /v1/traces when it names only a host."""
    return endpoint.rstrip("/") + TRACES_PATH if urlsplit(endpoint).path in ("", "/") else endpoint


def _resource() -> Resource:
    """OTEL_SERVICE_NAME and OTEL_RESOURCE_ATTRIBUTES win; the service name defaults to ours."""
    detected = Resource.create()
    if str(detected.attributes.get(SERVICE_NAME, "")).startswith("unknown_service"):
        return detected.merge(Resource({SERVICE_NAME: "poolserve"}))
    return detected


class OTelTracing:
    """A tracer provider of our own (the global one is left alone) with a batching exporter."""

    def __init__(self, endpoint: str, exporter: SpanExporter | None = None) -> None:
        self.provider = TracerProvider(resource=_resource())
        exporter = exporter or OTLPSpanExporter(endpoint=traces_url(endpoint))
        self.provider.add_span_processor(BatchSpanProcessor(exporter))
        self.tracer = self.provider.get_tracer("poolserve")
        self.propagator = TraceContextTextMapPropagator()
        self.offset_ns = time.time_ns() - time.monotonic_ns()

    def ns(self, instant: float) -> int:
        """A time.monotonic() instant as nanoseconds since the epoch."""
        return int(instant * 1e9) + self.offset_ns

    def start(
        self, scope: Scope, headers: Mapping[str, str], start: float, request_id: str
    ) -> RequestTrace:
        """The server span, a child of the caller's traceparent when it sent a valid one."""
        method = str(scope.get("method", "GET"))
        client = scope.get("client")
        attributes: dict[str, str | int] = {
            "http.request.method": method,
            "url.path": clip(str(scope.get("path", ""))),  # bounded: a head may be 32 KiB
            "poolserve.request_id": request_id,
        }
        if client:
            attributes["client.address"] = str(client[0])
        span = self.tracer.start_span(
            method,
            context=self.propagator.extract(headers),
            kind=SpanKind.SERVER,
            attributes=attributes,
            start_time=self.ns(start),
        )
        if not span.is_recording():  # not sampled: nothing more to do for it
            return NO_TRACE
        return OTelRequestTrace(self, span, method)

    def shutdown(self) -> None:
        """Flush and stop the exporter, waiting SHUTDOWN_TIMEOUT_S at most."""
        worker = threading.Thread(target=self.provider.shutdown, daemon=True, name="otel-flush")
        worker.start()
        worker.join(SHUTDOWN_TIMEOUT_S)


class OTelRequestTrace:
    """One request's server span and what its children need."""

    def __init__(self, tracing: OTelTracing, span: Span, method: str) -> None:
        self.tracing = tracing
        self.span = span
        self.method = method
        self.context = set_span_in_context(span)
        self.timelines: list[RequestTimeline] = []

    @property
    def trace_id(self) -> str | None:
        """The trace's id in hex."""
        return format_trace_id(self.span.get_span_context().trace_id)

    def record(self, span: SpanRecord) -> None:
        """Export a finished child span."""
        child = self.tracing.tracer.start_span(
            span.name,
            context=self.context,
            kind=SpanKind.INTERNAL,
            attributes=span.attributes,
            start_time=self.tracing.ns(span.start),
        )
        child.end(end_time=self.tracing.ns(span.end))

    def add_outputs(self, outputs: Iterable[PoolingOutput]) -> None:
        """Keep the timelines the engine recorded."""
        self.timelines.extend(o.timeline for o in outputs if o.timeline is not None)

    def set(self, attributes: Attributes) -> None:
        """Attributes on the server span."""
        self.span.set_attributes(attributes)

    def finish(self, route: str | None, status: int, end: float) -> None:
        """The engine's spans, then the server span named after its route, with the status."""
        for record in engine_spans(self.timelines):
            self.record(record)
        if route is not None:
            self.span.update_name(f"{self.method} {route}")
            self.span.set_attribute("http.route", route)
        self.span.set_attribute("http.response.status_code", status)
        if status >= 500:
            self.span.set_status(Status(StatusCode.ERROR))
        self.span.end(end_time=self.tracing.ns(end))
