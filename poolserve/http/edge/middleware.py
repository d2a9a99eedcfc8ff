"""Pure-ASGI edge: auth, body bounds, request id, headers, metrics, ends at a drain deadline."""

from __future__ import annotations

import asyncio
import hmac
import logging
import os
import re
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from poolserve.config.settings import ServerSettings
from poolserve.frontend.state import ServiceState
from poolserve.http.batches import BATCH_LINE, UPLOAD_PATH, upload_limit
from poolserve.http.edge.handlers import error_answer
from poolserve.http.errors import CLOSE, EdgeError, error_line, response_for
from poolserve.http.internals import matched_route
from poolserve.http.routing import route_path
from poolserve.http.tenants import TENANT_KEY, KeyRing, TenantKey
from poolserve.observability.logs import (
    ACCESS_LOGGER,
    API_KEY_NAME_KEY,
    CLIENT_CLOSED,
    LORA_KEY,
    MODEL_KEY,
    access_record,
    log_access,
)
from poolserve.observability.metrics import HTTP, NO_LORA, UNROUTED
from poolserve.observability.tracing import NO_TRACE, TRACE_KEY, RequestTrace
from poolserve.types.errors import (
    APIError,
    AuthenticationError,
    InvalidRequestError,
    PayloadTooLargeError,
    PermissionDeniedError,
    ShutdownError,
    clip,
)

logger = logging.getLogger(__name__)
ACCESS_LOG = logging.getLogger(ACCESS_LOGGER)

MISSING_KEY = "missing or invalid API key (send Authorization: Bearer KEY)"
OPEN_PATHS = frozenset({"/health", "/ready", "/ping", "/metrics", "/version"})
# Sent twice, these could be read one way by a proxy and another by us: refused.
SINGLE_HEADERS = frozenset({"authorization", "content-length", "content-type", "host"})
REQUEST_ID = re.compile(r"[A-Za-z0-9._-]{1,128}")
# uuid.uuid4().hex without building a UUID object (a third of its cost): version 4, RFC variant
_UUID4_KEEP = ~((0xF000 << 64) | (0xC000 << 48))
_UUID4_SET = (0x4000 << 64) | (0x8000 << 48)


def open_paths(settings: ServerSettings) -> frozenset[str]:
    """The paths that need no key: the probes, the metrics, the version, and Vertex AI's health
    route where it names its own (AIP_HEALTH_ROUTE)."""
    health = settings.vertex_health_route
    return OPEN_PATHS if health is None else OPEN_PATHS | {health}


def is_open(scope: Scope, paths: frozenset[str] = OPEN_PATHS) -> bool:
    """Probes, metrics and the version need no key, with or without the --root-path prefix."""
    return route_path(scope) in paths


SECURITY_HEADERS = [(b"x-content-type-options", b"nosniff")]
NDJSON = b"application/x-ndjson"
# How long the answers at a drain deadline may take before their connections are dropped.
SEND_TIMEOUT_S = 0.25
# Outside a DrainingServer nobody drops stalled connections: the answer gives up by itself.
ANSWER_TIMEOUT_S = 1.0
# A batch file's upload may take --body-timeout plus the time its bytes need at this rate.
UPLOAD_BYTES_PER_S = 1 << 20


@dataclass(eq=False)
class Exchange:
    """One request in flight, as the edge sees it."""

    task: asyncio.Task[Any]
    open_path: bool = False  # a probe, the metrics or the version: no key, not counted
    status: int = 500  # what is counted when the app fails before answering
    started: bool = False
    complete: bool = False
    streaming: bool = False
    at_line_end: bool = True
    client_gone: bool = False
    stopping: bool = False  # the drain deadline passed: end at the stream's next line end
    stopped: bool = False  # the task was cancelled for it

    def stop(self) -> None:
        """End this request now, or at its stream's next line end so no line is cut."""
        self.stopping = True
        if not self.streaming or self.at_line_end:
            self.cut()

    def cut(self) -> None:
        """End this request now."""
        if not self.stopped and not self.complete:
            self.stopped = True
            self.task.cancel("the drain deadline passed")

    def outcome(self) -> int:
        """The status to count: 499 when the client left first, 503 when the deadline ended it."""
        if self.client_gone and not self.complete:
            return CLIENT_CLOSED
        if self.stopped and not self.complete:
            return ShutdownError.status
        return self.status


class InFlight:
    """The requests being served, so that a drain's deadline can end each with an answer."""

    def __init__(self) -> None:
        self.exchanges: set[Exchange] = set()

    async def end(self, grace_s: float, abort_stalled: Callable[[], None]) -> None:
        """503 for unanswered requests, a last error line for streams; then drop stalled readers.

        abort_stalled closes connections whose client stopped reading, which unblocks their
        sends: nothing then waits on a client.
        """
        for exchange in list(self.exchanges):
            exchange.stop()
        await self._wait(grace_s)
        for exchange in list(self.exchanges):
            exchange.cut()  # a stream still mid-line after the grace: its reader is stalled
        await self._wait(SEND_TIMEOUT_S)
        abort_stalled()
        await self._wait(SEND_TIMEOUT_S)

    async def _wait(self, seconds: float) -> None:
        deadline = time.monotonic() + seconds
        while self.exchanges and time.monotonic() < deadline:
            await asyncio.sleep(0.01)


class EdgeMiddleware:
    """Everything a request meets before its route, and the accounting after it."""

    def __init__(
        self,
        app: ASGIApp,
        *,
        state: ServiceState,
        inflight: InFlight,
        keys: KeyRing | None = None,
    ) -> None:
        self.app = app
        self.state = state
        self.inflight = inflight
        api_key = state.settings.api_key
        self.api_key = api_key.encode() if api_key else None
        self.keys = keys  # --api-keys-file (with --api-key among its keys)
        # chosen once: without a keys file a request pays nothing for it
        self._authorize = self._check_auth if keys is None else self._check_tenant
        self.payload_limit = state.settings.payload_limit
        self.body_timeout = state.settings.body_timeout
        # POST /v1/files (--batch-dir) takes a batch file: its own size bound and time
        self.upload_limit = upload_limit(state.settings)
        self.open_paths = open_paths(state.settings)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        if BATCH_LINE in scope.get("extensions", ()):  # only this process's batch runner
            await self._serve_line(scope, receive, send)
            return
        start = time.monotonic()
        task = asyncio.current_task()
        assert task is not None
        exchange = Exchange(task, is_open(scope, self.open_paths))
        headers, repeated = _first_values(scope["headers"])
        given = headers.get("x-request-id")
        # kept in the request's state, so a route may adopt a body's request_id (vLLM's field)
        state = scope.setdefault("state", {})
        request_id = state["request_id"] = _request_id(given)
        state["request_id_given"] = request_id == given
        send_edge = self._sender(exchange, send, state)
        counted = not exchange.open_path
        trace = self.state.tracing.start(scope, headers, start, request_id) if counted else NO_TRACE
        state[TRACE_KEY] = trace
        self.state.active_requests += counted
        self.inflight.exchanges.add(exchange)
        try:
            receive_edge = self._receiver(exchange, receive, *self._bounds(scope))
            await self._serve(scope, receive_edge, send_edge, exchange, headers, repeated)
        except asyncio.CancelledError:
            if not exchange.stopped:
                raise
            exchange.task.uncancel()
            await self._answer_stopped(exchange, scope, receive, send_edge)
        finally:
            self.inflight.exchanges.discard(exchange)
            self.state.active_requests -= counted
            # the id the response carried: a route may have adopted the body's request_id
            self._record(scope, exchange, start, str(state["request_id"]), trace)

    async def _serve(
        self,
        scope: Scope,
        receive: Receive,
        send: Send,
        exchange: Exchange,
        headers: dict[str, str],
        repeated: str | None,
    ) -> None:
        """Refuse at the edge, or run the app; what escapes it is answered here, once."""
        try:
            self._check(scope, exchange.open_path, headers, repeated, self._bounds(scope)[0])
        except APIError as exc:
            await response_for(exc, CLOSE)(scope, receive, send)
            return
        try:
            await self.app(scope, receive, send)
        except Exception as exc:
            if exchange.started:
                raise
            # what the app left unanswered (a direct route's errors, a bug) is answered here by
            # the app's own table rather than by Starlette's outermost handler, so a bug is
            # logged once and its 500 carries the edge's headers
            await error_answer(exc, scope)(scope, receive, send)

    async def _serve_line(self, scope: Scope, receive: Receive, send: Send) -> None:
        """A batch line of this process's runner: no key (its batch's was checked), no limits
        and no accounting (it is no client's request), its owner's routes and models still."""
        state = scope.setdefault("state", {})
        state["request_id"] = _request_id(None)
        state["request_id_given"] = False
        state[TRACE_KEY] = NO_TRACE
        try:
            self._check_line(scope, state)
        except APIError as exc:
            await response_for(exc)(scope, receive, send)
            return
        try:
            await self.app(scope, receive, send)
        except Exception as exc:  # what the app left unanswered, answered by the app's table
            await error_answer(exc, scope)(scope, receive, send)

    def _check_line(self, scope: Scope, state: dict[str, Any]) -> None:
        if self.keys is None:
            return
        owner = scope["extensions"][BATCH_LINE]
        tenant = self.keys.named(owner) if isinstance(owner, str) else None
        if tenant is None:
            message = f"the API key named {clip(str(owner))!r} that made the batch is gone"
            raise AuthenticationError(message)
        state[TENANT_KEY] = TenantKey(tenant.spec, tenant.usage, limited=False)
        state[API_KEY_NAME_KEY] = tenant.name
        path = route_path(scope)
        tenant.usage.counted.inc()
        if not tenant.spec.allows_route(path):
            message = f"this API key may not use {clip(path)}"
            raise PermissionDeniedError(message, None, "route_not_allowed")

    def _bounds(self, scope: Scope) -> tuple[int, float]:
        """The request's body limit and the seconds it has to send the body."""
        upload = self.upload_limit
        if upload is None or scope["method"] != "POST" or route_path(scope) != UPLOAD_PATH:
            return self.payload_limit, self.body_timeout
        return upload, self.body_timeout + upload / UPLOAD_BYTES_PER_S

    def _check(
        self,
        scope: Scope,
        open_path: bool,
        headers: dict[str, str],
        repeated: str | None,
        limit: int,
    ) -> None:
        if repeated is not None:
            raise InvalidRequestError(
                f"the {repeated} header must be sent once", repeated, "duplicate_header"
            )
        self._authorize(scope, open_path, headers)
        declared = headers.get("content-length")
        if declared is not None and declared.isdigit() and int(declared) > limit:
            raise self._too_large(limit)

    def _check_auth(self, scope: Scope, open_path: bool, headers: dict[str, str]) -> None:
        if self.api_key is None or open_path:
            return
        given = headers.get("authorization", "")
        token = given[7:].strip() if given.lower().startswith("bearer ") else ""
        if not hmac.compare_digest(token.encode("latin-1"), self.api_key):
            raise AuthenticationError(MISSING_KEY)

    def _check_tenant(self, scope: Scope, open_path: bool, headers: dict[str, str]) -> None:
        """A keys file's key: 401 unknown, 403 a route it may not use, 429 its limit spent."""
        if open_path:
            return
        assert self.keys is not None
        tenant = self.keys.find(_bearer(headers))
        if tenant is None:
            raise AuthenticationError(MISSING_KEY)
        noted = scope["state"]
        noted[TENANT_KEY] = tenant
        noted[API_KEY_NAME_KEY] = tenant.name  # what later features scope a tenant's data by
        tenant.admit(route_path(scope), time.monotonic())

    def _too_large(self, limit: int) -> PayloadTooLargeError:
        flag = "--payload-limit" if limit == self.payload_limit else "--max-batch-file-bytes"
        return PayloadTooLargeError(
            f"request body is larger than the limit of {limit} bytes ({flag})"
        )

    def _receiver(
        self, exchange: Exchange, receive: Receive, limit: int, seconds: float
    ) -> Receive:
        """Bound the body in size and time; note a client that goes away."""
        seen = 0
        body_done = False
        deadline = asyncio.get_running_loop().time() + seconds

        async def receive_edge() -> Message:
            nonlocal seen, body_done
            if body_done:  # only the disconnect is left to wait for: no timer
                message = await receive()
                if message["type"] == "http.disconnect" and not exchange.complete:
                    exchange.client_gone = True
                return message
            try:
                async with asyncio.timeout_at(deadline):
                    message = await receive()
            except TimeoutError:
                raise EdgeError(
                    408,
                    f"the request body did not arrive within {seconds:g} s (--body-timeout)",
                    "body_timeout",
                    CLOSE,
                ) from None
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                body_done = not message.get("more_body", False)
                if seen > limit:
                    too_large = self._too_large(limit)
                    raise EdgeError(413, too_large.message, too_large.code, CLOSE)
            elif message["type"] == "http.disconnect" and not exchange.complete:
                exchange.client_gone = True
            return message

        return receive_edge

    def _sender(self, exchange: Exchange, send: Send, state: dict[str, Any]) -> Send:
        """Add the edge's headers and keep track of what has been sent."""

        async def send_edge(message: Message) -> None:
            if message["type"] == "http.response.start":
                headers = list(message.get("headers", ()))
                closes = False
                for key, value in headers:
                    if key == b"connection":
                        closes = True
                    elif key == b"content-type" and value.startswith(NDJSON):
                        exchange.streaming = True
                headers += SECURITY_HEADERS
                headers.append((b"x-request-id", str(state["request_id"]).encode()))
                if (self.state.draining or self.state.leaving) and not closes:
                    headers.append((b"connection", b"close"))  # keep-alive clients go elsewhere
                exchange.status, exchange.started = message["status"], True
                message = {**message, "headers": headers}
            await send(message)
            if message["type"] == "http.response.body":
                body = message.get("body", b"")
                exchange.at_line_end = exchange.at_line_end if not body else body.endswith(b"\n")
                exchange.complete = not message.get("more_body", False)
            if exchange.stopping and exchange.at_line_end:
                exchange.cut()

        return send_edge

    async def _answer_stopped(
        self, exchange: Exchange, scope: Scope, receive: Receive, send: Send
    ) -> None:
        """The drain deadline ended this request: a JSON 503, or a stream's last error line."""
        error = ShutdownError("the server shut down before this request finished")
        try:
            if not exchange.started:
                answer = response_for(error, CLOSE)(scope, receive, send)
                await asyncio.wait_for(answer, ANSWER_TIMEOUT_S)
            elif exchange.streaming and not exchange.complete:
                line = (b"" if exchange.at_line_end else b"\n") + error_line(error)
                last = {"type": "http.response.body", "body": line, "more_body": False}
                await asyncio.wait_for(send(last), ANSWER_TIMEOUT_S)
        except TimeoutError:
            logger.info("abandoned the answer to a client that stopped reading")

    def _record(
        self, scope: Scope, exchange: Exchange, start: float, request_id: str, trace: RequestTrace
    ) -> None:
        end = time.monotonic()
        route: Any = matched_route(scope)
        endpoint = getattr(route, "path", None) or "unmatched"
        noted = scope.get("state", {})
        task = str(noted.get("task", "none"))
        model = noted.get(MODEL_KEY)  # the served name the pipeline routed it to
        lora = noted.get(LORA_KEY)  # the LoRA adapter it ran through, if any
        status = exchange.outcome()
        trace.finish(getattr(route, "path", None), status, end)
        if self.state.settings.access_log:  # its 499 line says the client closed the connection
            level = logging.DEBUG if exchange.open_path else logging.INFO
            if ACCESS_LOG.isEnabledFor(level):
                record = access_record(
                    scope, endpoint, status, end - start, request_id, trace.trace_id
                )
                log_access(ACCESS_LOG, record, level)
        elif status == CLIENT_CLOSED:
            logger.info(
                "client closed the connection before its answer: %s %s",
                scope["method"],
                clip(scope["path"]),
            )
        # looked up per request: tests replace the state's metrics
        self.state.metrics.transports[HTTP].add(
            model if isinstance(model, str) else UNROUTED,
            lora if isinstance(lora, str) else NO_LORA,
            endpoint,
            task,
            status,
            end - start,
        )


def _bearer(headers: dict[str, str]) -> bytes:
    """The key an Authorization: Bearer header carries (empty without one)."""
    given = headers.get("authorization", "")
    return (given[7:].strip() if given.lower().startswith("bearer ") else "").encode("latin-1")


def _first_values(raw: Iterable[tuple[bytes, bytes]]) -> tuple[dict[str, str], str | None]:
    """The first value of each header, and the name of a single-valued one sent twice."""
    headers: dict[str, str] = {}
    repeated = None
    for key, value in raw:
        name = key.decode("latin-1").lower()
        if name not in headers:
            headers[name] = value.decode("latin-1")
        elif name in SINGLE_HEADERS and repeated is None:
            repeated = name
    return headers, repeated


def _request_id(given: str | None) -> str:
    """The client's id when it is short and plain (it is echoed and logged), else a new one."""
    if given is not None and REQUEST_ID.fullmatch(given):
        return given
    return f"{int.from_bytes(os.urandom(16)) & _UUID4_KEEP | _UUID4_SET:032x}"
