"""Every use of uvicorn's, FastAPI's and Starlette's private or undocumented API, in one place.

The rest of poolserve/http uses their public API and this module. What this module relies on:

uvicorn (`uvicorn.protocols.http.httptools_impl.HttpToolsProtocol`, `uvicorn.server`):
- the protocol class given as `uvicorn.Config(http=...)` is built with `config=` (and more);
- the protocol's callbacks `connection_made`, `connection_lost`, `data_received`, httptools'
  `on_message_begin`, `on_url`, `on_header`, `on_headers_complete`, `on_message_complete`, and
  `send_400_response`, which it calls when a parser callback raises;
- the protocol's attributes `loop`, `transport` (every byte of an answer is written through
  it), `scope` (the request being parsed), `cycle` (`response_complete`) and
  `server_state.default_headers`;
- `Server.handle_exit`, `Server.on_tick` (each tick of the main loop), `Server.shutdown`,
  `Server.should_exit` and `Server.server_state.connections`: the protocols, each with
  `shutdown()` (close when idle, else after the answer) and `transport`.

FastAPI (`fastapi.routing.APIRoute`, its `Dependant` and the body's `ModelField`):
- `APIRoute.dependant`: its parameter lists, special parameter names, `call` and
  `request_param_name`; `APIRoute._embed_body_fields`;
- the body field's `field_info.annotation`, `name` and `validate(value, values, loc=...)`, the
  call FastAPI's request handler validates a body with (its errors, its locations);
- FastAPI's request handler parses a JSON body with `Request.json()`, which
  `poolserve.http.routing.StrictJSONRequest` overrides (no access here: the test checks it).

Starlette (`starlette.routing.Route`, `starlette.requests.Request`):
- `Route.param_convertors`; `Request._body`, the body as far as it was read and kept;
- the scope keys routing sets for a matched route: `route`, `endpoint` and `path_params`.

`TESTED` holds the minor versions these were tested with; tests/http/test_internals.py fails
on any other installed minor version and checks each hook against the installed classes.
"""

from __future__ import annotations

import asyncio
import inspect
import socket
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass
from functools import partial
from http import HTTPStatus
from importlib.metadata import version
from types import FrameType
from typing import Any, Generic, TypeVar, cast

import uvicorn
from fastapi.exceptions import RequestValidationError
from fastapi.routing import APIRoute
from pydantic import BaseModel
from starlette.requests import Request
from starlette.responses import Response
from starlette.types import Scope
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from poolserve.frontend.callers import CLOSE_WATCH

# The minor versions (`major.minor`) the edge's tests passed with. Another installed minor fails
# tests/http/test_internals.py: run the edge tests on it, then add it here and widen
# pyproject.toml's bounds and constraints.txt.
TESTED: dict[str, frozenset[str]] = {
    "fastapi": frozenset({"0.165"}),
    "starlette": frozenset({"1.10"}),
    "uvicorn": frozenset({"0.54"}),
}


def installed_minor(package: str) -> str:
    """`major.minor` of the installed distribution."""
    return ".".join(version(package).split(".")[:2])


def untested() -> dict[str, str]:
    """The installed minor versions that are not in TESTED, by package."""
    installed = {package: installed_minor(package) for package in TESTED}
    return {package: minor for package, minor in installed.items() if minor not in TESTED[package]}


# ---- uvicorn: the HTTP/1.1 protocol and the server's steps ----

# Request line plus headers; uvicorn bounds them for h11 only, httptools takes any size.
HEAD_LIMIT_BYTES = 32 * 1024
# One response header, as ASGI and uvicorn write them.
Header = tuple[bytes, bytes]


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


class BoundedHttpProtocol(HttpToolsProtocol):
    """httptools with the bounds uvicorn leaves open for it: request head size and time.

    Writes are corked (`CorkedTransport`) and each request's scope carries `CLOSE_WATCH`. What
    it refuses is answered by `refuse` with `refusal`'s headers and body: plain text here, the
    server's JSON error document in its subclass.
    The head timeout is the config's `head_timeout_s` (30 s without one).
    """

    def __init__(self, config: uvicorn.Config, *args: Any, **kwargs: Any) -> None:
        super().__init__(config, *args, **kwargs)
        self.head_timeout_s: float = getattr(config, "head_timeout_s", 30.0)
        self.head_bytes = 0  # bytes received while a head is incomplete
        self.head_size = 0  # parsed size of the current head
        self.in_head = True  # the next bytes belong to a request line or headers
        self.head_timer: asyncio.TimerHandle | None = None
        self.closed = False
        self.close_watchers: set[Callable[[], None]] = set()

    def refusal(self, status: int, message: str, code: str) -> tuple[list[Header], bytes]:
        """The headers (besides length and close) and body of a refusal: the message as text."""
        return [(b"content-type", b"text/plain; charset=utf-8")], message.encode()

    def refuse(self, status: int, message: str, code: str) -> None:
        """Answer a request the app never sees (no request to route yet) and close."""
        headers, body = self.refusal(status, message, code)
        length = (b"content-length", str(len(body)).encode())
        self.answer_and_close(status, [length, (b"connection", b"close"), *headers], body)

    def answer_and_close(
        self, status: int, headers: Iterable[tuple[bytes, bytes]], body: bytes
    ) -> None:
        """Write a whole answer outside the app, after uvicorn's default headers; close."""
        headers = [*self.server_state.default_headers, *headers]
        status_line = f"HTTP/1.1 {status} {HTTPStatus(status).phrase}\r\n".encode()
        head = b"".join(name + b": " + value + b"\r\n" for name, value in headers)
        self.transport.write(status_line + head + b"\r\n" + body)
        self.transport.close()

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
        """Bytes after this message start the next head; reading goes on, so a client that
        leaves while its work runs is heard (CLOSE_WATCH frees the work)."""
        super().on_message_complete()
        self.in_head = True
        # uvicorn pauses reading while more than 64 KiB of body waits for the app, and resumes
        # only when the app asks for more: the last piece of a large body left it paused, so
        # the client's close was never read and a disconnected client's work ran to the end. A
        # pipelined next request's body pauses reading again past the same 64 KiB.
        if not self.transport.is_closing():
            self.flow.resume_reading()

    def send_400_response(self, msg: str) -> None:
        """A request httptools cannot parse: the subclass's answer, not uvicorn's plain text."""
        if self.head_size > HEAD_LIMIT_BYTES:
            self._refuse_large_head()
        else:
            self.refuse(400, "the request is not valid HTTP/1.1", "invalid_http")

    def _refuse_large_head(self) -> None:
        message = f"request headers are larger than the limit of {HEAD_LIMIT_BYTES} bytes"
        self.refuse(431, message, "headers_too_large")

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
            self.refuse(408, message, "head_timeout")
        else:
            self.transport.close()


class HookedServer(uvicorn.Server):
    """uvicorn's server, its exit signal, main-loop tick and shutdown open to a subclass."""

    def exit_signal(self, sig: int) -> bool:
        """An exit signal (SIGINT, SIGTERM) arrived: True when handled, else uvicorn exits."""
        return False

    def tick(self) -> None:
        """Each tick of uvicorn's main loop (ten a second), before uvicorn's own."""

    async def before_shutdown(self) -> None:
        """The main loop ended: runs before uvicorn closes the listeners and connections."""

    def request_exit(self) -> None:
        """Leave the main loop at its next tick, then shut down."""
        self.should_exit = True

    def shutdown_connections(self) -> None:
        """Idle keep-alive connections close now, busy ones after their answer."""
        for connection in list(self.server_state.connections):
            connection.shutdown()

    def abort_stalled(self) -> None:
        """Drop connections with unsent bytes: their readers stopped, every answer is out."""
        for connection in list(self.server_state.connections):
            transport = getattr(connection, "transport", None)
            if transport is not None and transport.get_write_buffer_size() > 0:
                transport.abort()

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        """uvicorn's signal handler: `exit_signal` first."""
        if not self.exit_signal(sig):
            super().handle_exit(sig, frame)

    async def on_tick(self, counter: int) -> bool:
        """uvicorn's tick, after `tick`."""
        self.tick()
        return await super().on_tick(counter)

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        """uvicorn's shutdown, after `before_shutdown`."""
        await self.before_shutdown()
        await super().shutdown(sockets)


# ---- FastAPI and Starlette: the direct way to a body-only route ----

RouteT = TypeVar("RouteT", bound=APIRoute)


@dataclass(frozen=True)
class DirectBody(Generic[RouteT]):
    """How one JSON body model reaches its endpoint without FastAPI's dependency solving."""

    route: RouteT
    field: Any  # FastAPI's ModelField of the body parameter
    endpoint: Callable[..., Awaitable[Response]]
    request_name: str | None

    async def call(self, request: Request, document: Any) -> Response:
        """Validate the parsed body as FastAPI does (its TypeAdapter and errors); run the route."""
        value, errors = self.field.validate(document, {}, loc=("body",))
        if errors:
            raise RequestValidationError(errors, body=document)
        arguments = {self.field.name: value}
        if self.request_name is not None:
            arguments[self.request_name] = request
        return await self.endpoint(**arguments)


def direct_body(route: RouteT) -> DirectBody[RouteT] | None:
    """The route's body model and endpoint, when it has no path parameters and its body model
    (and the request) is all it takes, and it answers a Response."""
    if route.param_convertors:
        return None
    dependant = route.dependant
    others = (dependant.path_params, dependant.query_params, dependant.header_params)
    special = (
        dependant.websocket_param_name,
        dependant.http_connection_param_name,
        dependant.response_param_name,
        dependant.background_tasks_param_name,
        dependant.security_scopes_param_name,
    )
    if any(others) or dependant.cookie_params or dependant.dependencies or any(special):
        return None
    if len(dependant.body_params) != 1 or getattr(route, "_embed_body_fields", True):
        return None
    field = dependant.body_params[0]
    model = field.field_info.annotation
    call = dependant.call
    if not (isinstance(model, type) and issubclass(model, BaseModel)):
        return None
    if not inspect.iscoroutinefunction(call):
        return None
    try:
        returns = inspect.signature(call, eval_str=True).return_annotation
    except (NameError, TypeError):
        return None
    if not (isinstance(returns, type) and issubclass(returns, Response)):
        return None
    return DirectBody(route, field, call, dependant.request_param_name)


def enter_route(scope: Scope, route: APIRoute) -> None:
    """Set what routing sets in the scope of a request matched to `route` (no path params)."""
    scope["route"], scope["endpoint"], scope["path_params"] = route, route.endpoint, {}


def matched_route(scope: Scope) -> Any:
    """The route routing matched the request to (`enter_route`'s too); None when none did."""
    return scope.get("route")


def cached_body(request: Request) -> bytes | None:
    """The body the request read and kept; None when it read none (or failed reading)."""
    return request._body if hasattr(request, "_body") else None
