"""Runs the app under uvicorn; SIGTERM drains, and the process exits within its timeout."""

from __future__ import annotations

import logging
import signal
import socket
import time
from collections.abc import AsyncIterator, Callable, Sequence
from contextlib import AbstractAsyncContextManager, AsyncExitStack, asynccontextmanager
from typing import Any

import orjson
import uvicorn

from poolserve.config.settings import ServerSettings
from poolserve.frontend.state import ServiceState
from poolserve.http.app import create_app
from poolserve.http.edge.middleware import SECURITY_HEADERS, InFlight
from poolserve.http.errors import error_document
from poolserve.http.internals import HEAD_LIMIT_BYTES, BoundedHttpProtocol, Header, HookedServer
from poolserve.http.tenants import KeyRing
from poolserve.observability.logs import report_start_failure

logger = logging.getLogger(__name__)
# a server that runs beside the HTTP one for as long as the app serves (the gRPC server), on the
# app's state and its --api-keys-file table (one per process: SIGHUP reloads it for both)
Beside = Callable[[ServiceState, KeyRing | None], AbstractAsyncContextManager[None]]
Lifespan = Callable[[Any], AbstractAsyncContextManager[Any]]

# After the drain deadline, a stream gets this long to reach a line end before it is cut.
STREAM_GRACE_S = 0.5
# uvicorn's own wait for connections, once every request has been answered or abandoned.
CLOSE_GRACE_S = 1


class DrainingServer(HookedServer):
    """A uvicorn server whose first exit signal starts a drain instead of closing sockets."""

    def __init__(self, config: uvicorn.Config, state: ServiceState, inflight: InFlight) -> None:
        super().__init__(config)
        self.state = state
        self.inflight = inflight
        self.drain_deadline: float | None = None
        self.refuse_at: float | None = None  # when new work starts getting 503

    def exit_signal(self, sig: int) -> bool:
        """First signal: readiness 503, then after --drain-delay new work 503; a second exits."""
        if self.drain_deadline is not None or not self.state.ready:
            return False
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
        return True

    def _start_refusing(self) -> None:
        """New work gets 503 from now on; idle keep-alive connections close.

        After the delay a load balancer has stopped routing here, so closing a connection it
        keeps idle races with no request; the busy ones close after their answer.
        """
        self.state.draining = True
        if self.state.settings.drain_delay > 0:
            self.shutdown_connections()

    def tick(self) -> None:
        """Refuse new work once the delay passed; exit once no work is left or at the deadline."""
        if self.drain_deadline is not None and self.refuse_at is not None:
            now = time.monotonic()
            if not self.state.draining and now >= self.refuse_at:
                self._start_refusing()
            engine_busy = any(served.engine.busy for served in self.state.models)
            idle = self.state.active_requests == 0 and not engine_busy
            if self.state.draining and (idle or now >= self.drain_deadline):
                self.request_exit()

    async def before_shutdown(self) -> None:
        """Answer what still runs (503, or a stream's error line), then let uvicorn close.

        uvicorn's graceful shutdown alone would wait its own timeout again, after the drain,
        for connections whose client stopped reading; those are aborted here instead.
        """
        self.state.draining = True
        if self.inflight.exchanges:
            logger.info("shutting down: ending %d request(s)", len(self.inflight.exchanges))
        await self.inflight.end(STREAM_GRACE_S, self.abort_stalled)


class EdgeConfig(uvicorn.Config):
    """uvicorn's config plus the request-head timeout that EdgeHttpProtocol enforces."""

    def __init__(self, app: Any, *, head_timeout_s: float, **kwargs: Any) -> None:
        super().__init__(app, **kwargs)
        self.head_timeout_s = head_timeout_s


class EdgeHttpProtocol(BoundedHttpProtocol):
    """httptools with the bounds uvicorn leaves open for it (request head size and time, corked
    writes, CLOSE_WATCH: see BoundedHttpProtocol); what it refuses gets the JSON error body."""

    def refusal(self, status: int, message: str, code: str) -> tuple[list[Header], bytes]:
        """The OpenAI-style error document, with the edge's security headers."""
        body = orjson.dumps(error_document(message, "invalid_request_error", None, code))
        return [(b"content-type", b"application/json"), *SECURITY_HEADERS], body


def run_server(
    settings: ServerSettings,
    core_address: str | None = None,
    sockets: list[socket.socket] | None = None,
    beside: Sequence[Beside] = (),
) -> bool:
    """Serve until drained: one process, or one front end of an engine core at core_address.
    False when the start failed (said in one line). `beside`: servers that run on the same loop
    once the models are served and stop before they close (the gRPC server)."""
    # a SIGHUP re-reads the keys file once the app has started (its lifespan installs that);
    # until then it must not end the process
    signal.signal(signal.SIGHUP, signal.SIG_IGN)
    app = create_app(settings, core_address, owns_process=True)
    state: ServiceState = app.state.poolserve
    if beside:
        lifespan = app.router.lifespan_context
        keys: KeyRing | None = app.state.api_keys
        app.router.lifespan_context = _with_beside(lifespan, state, keys, beside)
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
    if sockets:
        state.address = _address(sockets[0], "https" if settings.ssl_certfile else "http")
    server = DrainingServer(config, state, app.state.inflight)
    quiet = _SaidOnce(state)
    logging.getLogger("uvicorn.error").addFilter(quiet)
    try:
        server.run(sockets)  # uvicorn picks uvloop when installed
    except SystemExit:
        if state.start_failure is None:
            raise
    finally:
        logging.getLogger("uvicorn.error").removeFilter(quiet)
    return state.start_failure is None


def _with_beside(
    inner: Lifespan, state: ServiceState, keys: KeyRing | None, beside: Sequence[Beside]
) -> Lifespan:
    """The app's lifespan, with the `beside` servers inside it: started after it (the keys
    loaded), stopped first."""

    @asynccontextmanager
    async def lifespan(app: Any) -> AsyncIterator[None]:
        async with inner(app), AsyncExitStack() as stack:
            try:
                for start in beside:
                    await stack.enter_async_context(start(state, keys))
            except BaseException as exc:
                state.start_failure = exc
                report_start_failure("serve", exc)
                raise
            yield

    return lifespan


def _address(listener: socket.socket, scheme: str) -> str:
    """The URL a listening socket answers at (its real port when --port 0 let the kernel pick)."""
    host, port = listener.getsockname()[:2]
    return f"{scheme}://[{host}]:{port}" if ":" in host else f"{scheme}://{host}:{port}"


class _SaidOnce(logging.Filter):
    """A start that failed was said in one line (`report_start_failure`): uvicorn's error
    records of it (the lifespan's traceback, "Application startup failed") say it again."""

    def __init__(self, state: ServiceState) -> None:
        super().__init__()
        self.state = state

    def filter(self, record: logging.LogRecord) -> bool:
        return record.levelno < logging.ERROR or self.state.start_failure is None
