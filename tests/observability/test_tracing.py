"""OpenTelemetry traces of a real server process, received over OTLP/HTTP and decoded here.

One `poolserve serve` process exports to a receiver started by the test, which decodes each
POST with opentelemetry-proto's ExportTraceServiceRequest; the same process writes its logs
as JSON, checked line by line.
"""

from __future__ import annotations

import secrets
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import httpx
import orjson
import pytest
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)
from opentelemetry.proto.trace.v1.trace_pb2 import Span
from transformers import AutoTokenizer

from poolserve.config.flags import parse_settings
from tests.deploy.live import (
    SERVER_READY_TIMEOUT_S,
    LiveProcess,
    server_command,
    server_env,
    started,
    wait_ready,
)
from tests.deploy.tools import free_port, wait_until
from tests.tiny_models import MINILM_DIR

EXPORT_TIMEOUT_S = 30.0
TEXTS = ["the cat sat on the mat", "tracing shows where a request's time went, step by step"]
CHILDREN = {"tokenize", "queue", "engine.step", "encode"}


@dataclass(frozen=True)
class Received:
    """A decoded span with what the checks read."""

    name: str
    trace_id: str
    span_id: str
    parent_span_id: str
    kind: int
    start: int
    end: int
    attributes: dict[str, Any]


class Collector:
    """An OTLP/HTTP traces receiver on a loopback port: every span it was sent, decoded."""

    def __init__(self) -> None:
        self.spans: list[Received] = []
        self.lock = threading.Lock()
        collector = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers["Content-Length"]))
                if self.path != "/v1/traces" or "protobuf" not in self.headers["Content-Type"]:
                    self.send_response(404)
                    self.end_headers()
                    return
                request = ExportTraceServiceRequest()
                request.ParseFromString(body)
                collector.add(request)
                answer = ExportTraceServiceResponse().SerializeToString()
                self.send_response(200)
                self.send_header("Content-Type", "application/x-protobuf")
                self.send_header("Content-Length", str(len(answer)))
                self.end_headers()
                self.wfile.write(answer)

            def log_message(self, format: str, *args: object) -> None:
                """Quiet."""

        self.server = ThreadingHTTPServer(("127.0.0.1", free_port()), Handler)

    def add(self, request: ExportTraceServiceRequest) -> None:
        with self.lock:
            for resource_spans in request.resource_spans:
                for scope_spans in resource_spans.scope_spans:
                    self.spans.extend(_decoded(s) for s in scope_spans.spans)

    def trace(self, trace_id: str) -> list[Received]:
        with self.lock:
            return [s for s in self.spans if s.trace_id == trace_id]


def _decoded(span: Span) -> Received:
    attributes: dict[str, Any] = {}
    for kv in span.attributes:
        kind = kv.value.WhichOneof("value")
        attributes[kv.key] = getattr(kv.value, kind) if kind else None
    return Received(
        span.name,
        span.trace_id.hex(),
        span.span_id.hex(),
        span.parent_span_id.hex(),
        span.kind,
        span.start_time_unix_nano,
        span.end_time_unix_nano,
        attributes,
    )


@contextmanager
def collector() -> Iterator[Collector]:
    receiver = Collector()
    thread = threading.Thread(target=receiver.server.serve_forever, daemon=True)
    thread.start()
    try:
        yield receiver
    finally:
        receiver.server.shutdown()
        receiver.server.server_close()


@contextmanager
def traced_server(workdir: Path, endpoint: str) -> Iterator[LiveProcess]:
    """`poolserve serve` exporting traces to endpoint, logging JSON, ready."""
    port = free_port()
    live = LiveProcess("poolserve", f"http://127.0.0.1:{port}", workdir / "poolserve.log")
    env = server_env()
    # export within a fraction of a second rather than the SDK's default 5 s
    env["OTEL_BSP_SCHEDULE_DELAY"] = "100"
    args = [*server_command(port), "--otlp-traces-endpoint", endpoint, "--log-format", "json"]
    with started(live.name, args, env, live.log_path) as process:
        wait_ready(process, live, "/ready", SERVER_READY_TIMEOUT_S)
        yield live


@pytest.fixture(scope="module")
def tokenizer() -> Any:
    return AutoTokenizer.from_pretrained(MINILM_DIR)


def _traceparent() -> tuple[str, str, str]:
    trace_id, span_id = secrets.token_hex(16), secrets.token_hex(8)
    return f"00-{trace_id}-{span_id}-01", trace_id, span_id


def _spans(receiver: Collector, trace_id: str, names: set[str]) -> list[Received]:
    """The trace's spans once the server span and every expected child have arrived."""

    def probe() -> list[Received] | None:
        spans = receiver.trace(trace_id)
        return spans if names <= {s.name for s in spans} else None

    return wait_until(probe, EXPORT_TIMEOUT_S, f"spans {sorted(names)} of trace {trace_id}")


def _check_tree(spans: list[Received], server_name: str, caller_span_id: str) -> Received:
    """One server span under the caller's span; every other span its child, inside its times."""
    (server,) = [s for s in spans if s.name == server_name]
    assert server.parent_span_id == caller_span_id
    assert server.kind == Span.SpanKind.SPAN_KIND_SERVER
    for child in spans:
        if child is server:
            continue
        assert child.name in CHILDREN, child
        assert child.parent_span_id == server.span_id, child
        assert server.start <= child.start <= child.end <= server.end, child
    return server


def _check_engine(spans: list[Received], num_inputs: int, num_tokens: int) -> None:
    """The queue span counts the inputs; the steps' tokens of this request add up to its prompt."""
    (queue,) = [s for s in spans if s.name == "queue"]
    assert queue.attributes["poolserve.inputs"] == num_inputs
    steps = [s for s in spans if s.name == "engine.step"]
    assert steps
    assert sum(s.attributes["poolserve.request.tokens"] for s in steps) == num_tokens
    assert sum(s.attributes["poolserve.request.chunks"] for s in steps) == num_inputs
    for step in steps:
        own = step.attributes
        assert own["poolserve.step.tokens"] >= own["poolserve.request.tokens"]
        assert own["poolserve.step.seqs"] >= own["poolserve.request.chunks"]
    assert len({s.attributes["poolserve.step.index"] for s in steps}) == len(steps)


@pytest.mark.slow
def test_a_request_is_traced_end_to_end_and_logged_as_json(tmp_path: Path, tokenizer: Any) -> None:
    num_tokens = sum(len(ids) for ids in tokenizer(TEXTS)["input_ids"])
    with collector() as receiver:
        # a bare host:port endpoint: the server posts to its /v1/traces
        endpoint = f"http://127.0.0.1:{receiver.server.server_port}"
        with traced_server(tmp_path, endpoint) as live:
            traceparent, trace_id, caller_span = _traceparent()
            response = httpx.post(
                f"{live.base_url}/v1/embeddings",
                json={"input": TEXTS},
                headers={"traceparent": traceparent, "x-request-id": "trace-test-1"},
                timeout=30,
            )
            assert response.status_code == 200, response.text
            assert response.json()["usage"]["prompt_tokens"] == num_tokens
            spans = _spans(receiver, trace_id, {"POST /v1/embeddings", *CHILDREN})
            server = _check_tree(spans, "POST /v1/embeddings", caller_span)
            assert server.attributes["http.route"] == "/v1/embeddings"
            assert server.attributes["http.request.method"] == "POST"
            assert server.attributes["http.response.status_code"] == 200
            assert server.attributes["poolserve.prompt_tokens"] == num_tokens
            assert server.attributes["poolserve.task"] == "embed"
            assert server.attributes["poolserve.request_id"] == "trace-test-1"
            (tokenize,) = [s for s in spans if s.name == "tokenize"]
            assert tokenize.attributes["poolserve.prompt_tokens"] == num_tokens
            assert tokenize.attributes["poolserve.inputs"] == len(TEXTS)
            (encode,) = [s for s in spans if s.name == "encode"]
            assert encode.attributes["poolserve.output_bytes"] == len(response.content)
            _check_engine(spans, len(TEXTS), num_tokens)

            # a stream's outputs are traced as they finish
            traceparent, stream_trace, caller_span = _traceparent()
            streamed = httpx.post(
                f"{live.base_url}/v1/pooling",
                json={"input": TEXTS, "stream": True},
                headers={"traceparent": traceparent},
                timeout=30,
            )
            assert streamed.status_code == 200, streamed.text
            names = {"POST /v1/pooling", "tokenize", "queue", "engine.step"}
            spans = _spans(receiver, stream_trace, names)
            _check_tree(spans, "POST /v1/pooling", caller_span)
            _check_engine(spans, len(TEXTS), num_tokens)

            # without a traceparent the request starts a trace of its own
            plain = httpx.post(f"{live.base_url}/v1/score", json={"text_1": "a", "text_2": "b"})
            assert plain.status_code == 200, plain.text
            root = wait_until(lambda: _root(receiver, "POST /v1/score"), EXPORT_TIMEOUT_S, "root")
            assert root.parent_span_id == ""
        log = live.log_path.read_text()
    _check_json_log(log, trace_id, num_tokens)


def _root(receiver: Collector, name: str) -> Received | None:
    with receiver.lock:
        return next((s for s in receiver.spans if s.name == name), None)


def _check_json_log(log: str, trace_id: str, num_tokens: int) -> None:
    """Every line one JSON object with the stable keys; the traced request's access line."""
    records = []
    for line in log.splitlines():
        try:
            records.append(orjson.loads(line))
        except orjson.JSONDecodeError:
            pytest.fail(f"a log line is not JSON: {line!r}\n{log[-3000:]}", pytrace=False)
    for record in records:
        assert {"time", "level", "logger", "message"} <= record.keys(), record
    assert any(r["logger"].startswith("uvicorn") for r in records), "uvicorn's records too"
    (access,) = [r for r in records if r.get("request_id") == "trace-test-1"]
    assert access["logger"] == "poolserve.access"
    assert access["level"] == "INFO"
    assert access["method"] == "POST"
    assert access["path"] == access["route"] == "/v1/embeddings"
    assert access["status"] == 200
    assert access["prompt_tokens"] == num_tokens
    assert access["trace_id"] == trace_id
    assert access["duration_ms"] > 0
    assert access["client"] == "127.0.0.1"


def test_the_flag_without_the_packages_is_a_clear_startup_error(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    # None in sys.modules makes the import fail as if the package were not installed
    monkeypatch.setitem(sys.modules, "opentelemetry.sdk.trace", None)
    monkeypatch.delitem(sys.modules, "poolserve.observability.otel", raising=False)
    with pytest.raises(SystemExit) as exited:
        parse_settings(["serve", "--otlp-traces-endpoint", "http://localhost:4318"])
    assert exited.value.code == 2
    error = capsys.readouterr().err
    assert "--otlp-traces-endpoint needs the OpenTelemetry SDK" in error
    assert "opentelemetry.sdk.trace is not installed" in error
    assert "poolserve[tracing]" in error


def test_the_endpoint_must_be_an_http_url(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        parse_settings(["serve", "--otlp-traces-endpoint", "localhost:4318"])
    assert "must be an http:// or https:// URL" in capsys.readouterr().err
