"""Runs the app under uvicorn; SIGTERM drains, and the process exits within its timeout."""

from __future__ import annotations

import asyncio
import logging
import socket
import time
from collections.abc import Callable
from functools import partial
from http import HTTPStatus
from types import FrameType
from typing import Any, cast

import orjson
import uvicorn
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol
from uvicorn.server import ServerState as UvicornState

from poolserve.config.settings import ServerSettings
from poolserve.frontend.callers import CLOSE_WATCH
from poolserve.frontend.state import ServiceState
from poolserve.http.app import create_app
from poolserve.http.edge.middleware import SECURITY_HEADERS, InFlight
from poolserve.http.errors import error_document

logger = logging.getLogger(__name__)

# After the drain deadline, a stream gets this long to reach a line end before it is cut.
STREAM_GRACE_S = 0.5
# uvicorn's own wait for connections, once every request has been answered or abandoned.
CLOSE_GRACE_S = 1
# Request line plus headers; uvicorn bounds them for h11 only, httptools takes any size.
HEAD_LIMIT_BYTES = 32 * 1024


class DrainingServer(uvicorn.Server):
    """A uvicorn server whose first exit signal starts a drain instead of closing sockets."""

    def __init__(self, config: uvicorn.Config, state: ServiceState, inflight: InFlight) -> None:
        super().__init__(config)
        self.state = state
        self.inflight = inflight
        self.drain_deadline: float | None = None
        self.refuse_at: float | None = None  # when new work starts getting 503

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        """First signal: readiness 503, then after --drain-delay new work 503; a second exits."""
        if self.drain_deadline is not None or not self.state.ready:
            super().handle_exit(sig, frame)
            return
        settings = self.state.settings
        delay = min(settings.drain_delay, settings.shutdown_timeout)
        logger.info(
            "signal %d: not ready; refusing new work in %.1fs, exiting within %.1fs",
            sig,
            delay,
            settings.shutdown_timeout,
        )
        now = time.monotonic()
        self.state.leaving = True
        self.refuse_at = now + delay
        self.drain_deadline = now + settings.shutdown_timeout
        if delay == 0:
            self._start_refusing()

    def _start_refusing(self) -> None:
        """New work gets 503 from now on; idle keep-alive connections close.

        After the delay a load balancer has stopped routing here, so closing a connection it
        keeps idle races with no request; the busy ones close after their answer.
        """
        self.state.draining = True
        if self.state.settings.drain_delay > 0:
            for connection in list(self.server_state.connections):
                connection.shutdown()

    async def on_tick(self, counter: int) -> bool:
        """Refuse new work once the delay passed; exit once no work is left or at the deadline."""
        if self.drain_deadline is not None and self.refuse_at is not None:
            now = time.monotonic()
            if not self.state.draining and now >= self.refuse_at:
                self._start_refusing()
            engine_busy = any(served.engine.busy for served in self.state.models)
            idle = self.state.active_requests == 0 and not engine_busy
            if self.state.draining and (idle or now >= self.drain_deadline):
                self.should_exit = True
        return await super().on_tick(counter)

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        """Answer what still runs (503, or a stream's error line), then let uvicorn close.

        uvicorn's graceful shutdown alone would wait its own timeout again, after the drain,
        for connections whose client stopped reading; those are aborted here instead.
        """
        self.state.draining = True
        if self.inflight.exchanges:
            logger.info("shutting down: ending %d request(s)", len(self.inflight.exchanges))
        await self.inflight.end(STREAM_GRACE_S, lambda: _abort_stalled(self.server_state))
        await super().shutdown(sockets)


def _abort_stalled(server_state: UvicornState) -> None:
    """Drop connections with unsent bytes: their readers stopped, every answer is out."""
    for connection in list(server_state.connections):
        transport = getattr(connection, "transport", None)
        if transport is not None and transport.get_write_buffer_size() > 0:
            transport.abort()


class CorkedTransport:
    """A transport whose writes within one turn of the event loop leave in one system call.

    uvicorn writes a response's head and its body separately; on a busy server the system
    calls, not the bytes, are what a small answer costs. Everything else is the transport's.
    """

    def __init__(self, transport: asyncio.Transport) -> None:
        self._transport = transport
        self._parts: list[bytes] = []

    def write(self, data: bytes) -> None:
        """Queue bytes for the end of this loop turn."""
        if not data:
            return
        if not self._parts:
            asyncio.get_running_loop().call_soon(self._flush)
        self._parts.append(data)

    def _flush(self) -> None:
        parts, self._parts = self._parts, []
        if parts and not self._transport.is_closing():
            self._transport.writelines(parts)

    def close(self) -> None:
        """Write what is queued, then close."""
        self._flush()
        self._transport.close()

    def abort(self) -> None:
        """Drop what is queued and the connection."""
        self._parts.clear()
        self._transport.abort()

    def get_write_buffer_size(self) -> int:
        """Bytes not yet sent, queued here included."""
        queued = sum(len(part) for part in self._parts)
        return self._transport.get_write_buffer_size() + queued

    def __getattr__(self, name: str) -> Any:
        return getattr(self._transport, name)


class EdgeConfig(uvicorn.Config):
    """uvicorn's config plus the request-head timeout that EdgeHttpProtocol enforces."""

    def __init__(self, app: Any, *, head_timeout_s: float, **kwargs: Any) -> None:
        super().__init__(app, **kwargs)
        self.head_timeout_s = head_timeout_s


class EdgeHttpProtocol(HttpToolsProtocol):
    """httptools with the bounds uvicorn leaves open for it: request head size and time."""

    def __init__(self, config: uvicorn.Config, *args: Any, **kwargs: Any) -> None:
        super().__init__(config, *args, **kwargs)
        self.head_timeout_s: float = getattr(config, "head_timeout_s", 30.0)
        self.head_bytes = 0  # bytes received while a head is incomplete
        self.head_size = 0  # parsed size of the current head
        self.in_head = True  # the next bytes belong to a request line or headers
        self.head_timer: asyncio.TimerHandle | None = None
        self.closed = False
        self.close_watchers: set[Callable[[], None]] = set()

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        """Start the clock: a connection that sends nothing is closed too."""
        super().connection_made(cast(asyncio.Transport, CorkedTransport(transport)))
        self._arm_head_timer()

    def connection_lost(self, exc: Exception | None) -> None:
        """Stop the clock; tell the requests that wait for their answers."""
        self._disarm_head_timer()
        super().connection_lost(exc)
        self.closed = True
        watchers, self.close_watchers = self.close_watchers, set()
        for callback in watchers:
            callback()

    def _watch_close(self, callback: Callable[[], None]) -> Callable[[], None]:
        """CLOSE_WATCH: `callback()` once this connection closes; returns what stops watching."""
        if self.closed:
            self.loop.call_soon(callback)
        else:
            self.close_watchers.add(callback)
        return partial(self.close_watchers.discard, callback)

    def data_received(self, data: bytes) -> None:
        """Count head bytes; refuse once they pass the limit without the head being complete."""
        if self.in_head:
            self.head_bytes += len(data)
            self._arm_head_timer()
        super().data_received(data)
        if self.in_head and self.head_bytes > HEAD_LIMIT_BYTES and not self.transport.is_closing():
            self._refuse_large_head()

    def on_message_begin(self) -> None:
        """A new head starts; its request may watch the connection (no task of its own)."""
        super().on_message_begin()
        self.head_size = 0
        extensions: dict[str, Any] = self.scope.setdefault("extensions", {})
        extensions[CLOSE_WATCH] = self._watch_close

    def on_url(self, url: bytes) -> None:
        """Count the target toward the head limit."""
        self._grow_head(len(url))
        super().on_url(url)

    def on_header(self, name: bytes, value: bytes) -> None:
        """Count each header toward the head limit (a whole head can come in one read)."""
        self._grow_head(len(name) + len(value) + 4)
        super().on_header(name, value)

    def _grow_head(self, size: int) -> None:
        self.head_size += size
        if self.head_size > HEAD_LIMIT_BYTES:
            # stops the parser; uvicorn hands the error to send_400_response
            raise ValueError("request head too large")

    def on_headers_complete(self) -> None:
        """The head is in: the body has its own clock (the edge middleware's)."""
        self.in_head, self.head_bytes = False, 0
        self._disarm_head_timer()
        super().on_headers_complete()

    def on_message_complete(self) -> None:
        """Bytes after this message start the next head."""
        super().on_message_complete()
        self.in_head = True

    def send_400_response(self, msg: str) -> None:
        """A request httptools cannot parse: the JSON error body, not uvicorn's plain text."""
        if self.head_size > HEAD_LIMIT_BYTES:
            self._refuse_large_head()
        else:
            self._refuse(400, "the request is not valid HTTP/1.1", "invalid_http")

    def _refuse_large_head(self) -> None:
        message = f"request headers are larger than the limit of {HEAD_LIMIT_BYTES} bytes"
        self._refuse(431, message, "headers_too_large")

    def _arm_head_timer(self) -> None:
        if self.head_timer is None:
            self.head_timer = self.loop.call_later(self.head_timeout_s, self._head_timed_out)

    def _disarm_head_timer(self) -> None:
        if self.head_timer is not None:
            self.head_timer.cancel()
            self.head_timer = None

    def _head_timed_out(self) -> None:
        self.head_timer = None
        busy = self.cycle is not None and not self.cycle.response_complete
        if not self.in_head or busy or self.transport.is_closing():
            return  # a response is under way: uvicorn's keep-alive timer takes over after it
        if self.head_bytes:
            message = f"the request headers did not arrive within {self.head_timeout_s:g} s"
            self._refuse(408, message, "head_timeout")
        else:
            self.transport.close()

    def _refuse(self, status: int, message: str, code: str) -> None:
        """Answer outside the app (no request to route yet) and close."""
        body = orjson.dumps(error_document(message, "invalid_request_error", None, code))
        headers = [
            *self.server_state.default_headers,
            (b"content-type", b"application/json"),
            (b"content-length", str(len(body)).encode()),
            (b"connection", b"close"),
            *SECURITY_HEADERS,
        ]
        status_line = f"HTTP/1.1 {status} {HTTPStatus(status).phrase}\r\n".encode()
        head = b"".join(name + b": " + value + b"\r\n" for name, value in headers)
        self.transport.write(status_line + head + b"\r\n" + body)
        self.transport.close()


def run_server(
    settings: ServerSettings,
    core_address: str | None = None,
    sockets: list[socket.socket] | None = None,
) -> None:
    """Serve until drained: one process, or one front end of an engine core at core_address."""
    app = create_app(settings, core_address, owns_process=True)
    state: ServiceState = app.state.poolserve
    config = EdgeConfig(
        app,
        head_timeout_s=settings.body_timeout,
        host=settings.host,
        port=settings.port,
        log_level=settings.log_level,
        http=EdgeHttpProtocol,
        ws="none",  # no WebSocket routes: upgrade requests are plain HTTP requests
        timeout_graceful_shutdown=CLOSE_GRACE_S,
        h11_max_incomplete_event_size=HEAD_LIMIT_BYTES,
        server_header=False,
        access_log=False,  # the edge middleware writes the access log
        log_config=None,  # uvicorn's records go through the root handler (text or JSON)
        ssl_keyfile=settings.ssl_keyfile,  # both or neither: the settings check the pair
        ssl_certfile=settings.ssl_certfile,
    )
    server = DrainingServer(config, state, app.state.inflight)
    server.run(sockets)  # uvicorn picks uvloop when installed
