"""poolserve/http/internals.py: the installed web stack is a tested minor, the pins follow it,
and each hook on uvicorn's, FastAPI's and Starlette's private API still holds."""

from __future__ import annotations

import asyncio
import inspect
import re
import signal
import socket
import tomllib
from collections.abc import Callable
from pathlib import Path
from typing import Annotated, Any

import pytest
import uvicorn
from fastapi import Body, Depends, FastAPI, Request
from fastapi.encoders import jsonable_encoder
from fastapi.exceptions import RequestValidationError
from fastapi.routing import APIRoute
from packaging.requirements import Requirement
from packaging.version import Version
from pydantic import BaseModel
from starlette.responses import JSONResponse, Response
from starlette.testclient import TestClient
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol
from uvicorn.server import ServerState

from poolserve.frontend.callers import CLOSE_WATCH
from poolserve.http import internals
from poolserve.http.internals import (
    HEAD_LIMIT_BYTES,
    TESTED,
    BoundedHttpProtocol,
    DirectBody,
    HookedServer,
    cached_body,
    direct_body,
    enter_route,
    matched_route,
)

ROOT = Path(__file__).resolve().parents[2]
EDGE_TESTS = (
    "test_internals.py, test_edge.py, test_direct_routes.py, test_disconnects.py, test_shutdown.py"
)


# ---- versions and pins ----


def test_the_installed_web_stack_is_a_tested_minor_version() -> None:
    found = internals.untested()
    assert not found, (
        f"untested minor versions installed: {found}; tested: "
        f"{ {package: sorted(minors) for package, minors in TESTED.items()} }. "
        "poolserve/http/internals.py relies on their private API: run the edge tests "
        f"({EDGE_TESTS}), fix what breaks, then add the minor version to TESTED there "
        "and widen the bounds in pyproject.toml and the pins in constraints.txt"
    )


def _minor(text: str) -> tuple[int, int]:
    major, minor = text.split(".")[:2]
    return int(major), int(minor)


def test_pyproject_admits_exactly_the_tested_minor_versions() -> None:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    requirements = {Requirement(line).name: Requirement(line) for line in project["dependencies"]}
    for package, minors in TESTED.items():
        assert package in requirements, f"pyproject.toml does not name {package}"
        specifier = requirements[package].specifier
        tested = sorted(_minor(m) for m in minors)
        for major, minor in tested:
            assert specifier.contains(f"{major}.{minor}.0"), (package, str(specifier))
        (low_major, low), (high_major, high) = tested[0], tested[-1]
        below = f"{low_major}.{low - 1}.99" if low else f"{low_major - 1}.99.99"
        assert not specifier.contains(below), f"{package}{specifier} admits untested {below}"
        for above in (f"{high_major}.{high + 1}.0", f"{high_major + 1}.0.0"):
            assert not specifier.contains(above), f"{package}{specifier} admits untested {above}"


def test_constraints_pin_tested_minor_versions() -> None:
    pins = dict(
        re.findall(r"^([A-Za-z0-9._-]+)==(\S+)", (ROOT / "constraints.txt").read_text(), re.M)
    )
    for package, minors in TESTED.items():
        assert package in pins, f"constraints.txt does not pin {package}"
        release = Version(pins[package]).release
        assert f"{release[0]}.{release[1]}" in minors, (package, pins[package])


# ---- uvicorn: the protocol's callbacks and attributes ----

CALLBACKS = (
    "connection_made",
    "connection_lost",
    "data_received",
    "on_message_begin",
    "on_url",
    "on_header",
    "on_headers_complete",
    "on_message_complete",
    "send_400_response",
)


@pytest.mark.parametrize("name", CALLBACKS)
def test_each_overridden_callback_is_uvicorns(name: str) -> None:
    assert name in vars(BoundedHttpProtocol)
    theirs = getattr(HttpToolsProtocol, name)
    ours = getattr(BoundedHttpProtocol, name)
    assert list(inspect.signature(ours).parameters) == list(inspect.signature(theirs).parameters)


def test_only_the_listed_callbacks_are_overridden() -> None:
    overridden = {
        name
        for name in vars(BoundedHttpProtocol)
        if hasattr(HttpToolsProtocol, name) and not name.startswith("__")
    }
    assert overridden == set(CALLBACKS)


class FakeTransport(asyncio.Transport):
    """What uvicorn's protocol needs of a transport; keeps what is written."""

    def __init__(self) -> None:
        super().__init__()
        self.written = bytearray()
        self.closing = False
        self.aborted = False
        self.unsent = 0

    def get_extra_info(self, name: str, default: Any = None) -> Any:
        info = {"sockname": ("127.0.0.1", 8000), "peername": ("127.0.0.1", 50000)}
        return info.get(name, default)

    def write(self, data: Any) -> None:
        self.written += data

    def writelines(self, list_of_data: Any) -> None:
        for data in list_of_data:
            self.written += data

    def is_closing(self) -> bool:
        return self.closing

    def close(self) -> None:
        self.closing = True

    def abort(self) -> None:
        self.closing = self.aborted = True

    def get_write_buffer_size(self) -> int:
        return self.unsent

    def pause_reading(self) -> None:
        """A fake socket has no reads to pause."""

    def resume_reading(self) -> None:
        """Nor to resume."""


class Recording(BoundedHttpProtocol):
    """Refusals answered as the base protocol answers them; each kept."""

    refused: list[tuple[int, str]]

    def refuse(self, status: int, message: str, code: str) -> None:
        self.refused.append((status, code))
        super().refuse(status, message, code)


async def ok_app(scope: Any, receive: Any, send: Any) -> None:
    if scope["type"] != "http":
        return
    headers = [(b"content-length", b"2")]
    await send({"type": "http.response.start", "status": 200, "headers": headers})
    await send({"type": "http.response.body", "body": b"ok"})


def connect(head_timeout_s: float = 30.0) -> tuple[Recording, FakeTransport, ServerState]:
    """A protocol built as uvicorn builds it (keywords), over a fake transport."""
    config = uvicorn.Config(ok_app, http=Recording, ws="none", lifespan="off", log_config=None)
    config.head_timeout_s = head_timeout_s
    state = ServerState()
    state.default_headers = [(b"date", b"today")]
    protocol = Recording(config=config, server_state=state, app_state={})
    protocol.refused = []
    transport = FakeTransport()
    protocol.connection_made(transport)
    return protocol, transport, state


async def settle() -> None:
    for _ in range(5):  # corked writes leave at the end of the loop turn; the app's task runs
        await asyncio.sleep(0)


def test_a_request_passes_and_its_scope_has_the_close_watch() -> None:
    async def scenario() -> None:
        protocol, transport, state = connect()
        assert protocol in state.connections
        protocol.data_received(b"POST /x HTTP/1.1\r\nhost: a\r\ncontent-length: 2\r\n\r\n")
        assert not protocol.in_head and protocol.head_timer is None  # the body's clock now
        protocol.data_received(b"{}")
        assert protocol.in_head  # what comes next is the next head
        watch = protocol.scope["extensions"][CLOSE_WATCH]
        await settle()
        assert transport.written.startswith(b"HTTP/1.1 200 OK\r\n")
        assert protocol.cycle.response_complete
        seen: list[str] = []
        watch(lambda: seen.append("closed"))
        protocol.connection_lost(None)
        assert seen == ["closed"] and protocol not in state.connections

    asyncio.run(scenario())


def test_a_large_head_is_refused_by_the_subclass() -> None:
    async def scenario() -> None:
        protocol, transport, _ = connect()
        big = b"x" * HEAD_LIMIT_BYTES
        protocol.data_received(b"GET / HTTP/1.1\r\nhost: a\r\nx-big: " + big + b"\r\n\r\n")
        await settle()
        assert protocol.refused == [(431, "headers_too_large")]
        assert transport.written.startswith(b"HTTP/1.1 431 Request Header Fields Too Large\r\n")
        head, body = transport.written.split(b"\r\n\r\n", 1)
        assert head.endswith(
            b"\r\ndate: today\r\ncontent-length: %d\r\nconnection: close"
            b"\r\ncontent-type: text/plain; charset=utf-8" % len(body)
        )
        assert body == b"request headers are larger than the limit of %d bytes" % HEAD_LIMIT_BYTES
        assert transport.closing

    asyncio.run(scenario())


def test_an_incomplete_large_head_is_refused() -> None:
    async def scenario() -> None:
        protocol, _, _ = connect()
        protocol.data_received(b"GET / HTTP/1.1\r\nx-big: " + b"x" * (HEAD_LIMIT_BYTES + 1))
        assert protocol.refused == [(431, "headers_too_large")]

    asyncio.run(scenario())


def test_what_httptools_cannot_parse_reaches_send_400_response() -> None:
    async def scenario() -> None:
        protocol, transport, _ = connect()
        protocol.data_received(b"\x00\x01 not http\r\n\r\n")
        await settle()
        assert protocol.refused == [(400, "invalid_http")]
        assert transport.written.startswith(b"HTTP/1.1 400 Bad Request\r\n")

    asyncio.run(scenario())


def test_a_head_that_stops_times_out_and_silence_closes() -> None:
    async def scenario() -> None:
        protocol, _, _ = connect(head_timeout_s=0.01)
        protocol.data_received(b"GET / HTTP/1.1\r\n")
        await asyncio.sleep(0.05)
        assert protocol.refused == [(408, "head_timeout")]
        silent, transport, _ = connect(head_timeout_s=0.01)
        await asyncio.sleep(0.05)
        assert silent.refused == [] and transport.closing

    asyncio.run(scenario())


class Hooks(HookedServer):
    """Records each hook; handles exit signals when told to."""

    def __init__(self, config: uvicorn.Config, handles: bool) -> None:
        super().__init__(config)
        self.handles = handles
        self.calls: list[str] = []

    def exit_signal(self, sig: int) -> bool:
        self.calls.append(f"signal {sig}")
        return self.handles

    def tick(self) -> None:
        self.calls.append("tick")

    async def before_shutdown(self) -> None:
        self.calls.append(f"before shutdown, {len(self.server_state.connections)} connection(s)")


def test_an_exit_signal_goes_to_the_hook_first() -> None:
    config = uvicorn.Config(ok_app, log_config=None)
    handled = Hooks(config, handles=True)
    handled.handle_exit(signal.SIGTERM, None)
    assert handled.calls == [f"signal {signal.SIGTERM}"] and not handled.should_exit
    passed_on = Hooks(config, handles=False)
    passed_on.handle_exit(signal.SIGTERM, None)
    assert passed_on.should_exit


def test_ticks_exit_shutdown_and_connections_of_a_running_server() -> None:
    async def scenario() -> list[str]:
        config = uvicorn.Config(ok_app, lifespan="off", log_config=None, ws="none")
        server = Hooks(config, handles=True)
        listener = socket.create_server(("127.0.0.1", 0))
        port = listener.getsockname()[1]
        serving = asyncio.create_task(server.serve(sockets=[listener]))
        while not server.started:
            await asyncio.sleep(0.01)
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(b"GET / HTTP/1.1\r\nhost: a\r\n\r\n")
        assert (await reader.readuntil(b"ok")).startswith(b"HTTP/1.1 200 OK")
        assert len(server.server_state.connections) == 1
        server.shutdown_connections()  # idle keep-alive: closed now
        assert await asyncio.wait_for(reader.read(), 5) == b""
        writer.close()
        server.request_exit()
        await asyncio.wait_for(serving, 5)
        return server.calls

    calls = asyncio.run(scenario())
    assert "tick" in calls and calls[-1] == "before shutdown, 0 connection(s)"


def test_abort_stalled_drops_only_connections_with_unsent_bytes() -> None:
    server = HookedServer(uvicorn.Config(ok_app, log_config=None))

    class Connection:
        def __init__(self, unsent: int) -> None:
            self.transport = FakeTransport()
            self.transport.unsent = unsent

    stalled, drained = Connection(10), Connection(0)
    server.server_state.connections.update([stalled, drained])
    server.abort_stalled()
    assert stalled.transport.aborted and not drained.transport.aborted


# ---- FastAPI and Starlette: the direct way to a body-only route ----


class Item(BaseModel):
    name: str
    count: int = 1


def dependency() -> int:
    return 1


async def with_request(item: Item, request: Request) -> Response:
    return JSONResponse({"name": item.name, "path": request.url.path})


async def body_only(item: Item) -> JSONResponse:
    return JSONResponse({"name": item.name})


async def with_query(item: Item, q: int) -> Response:
    return Response()


async def with_dependency(item: Item, d: Annotated[int, Depends(dependency)]) -> Response:
    return Response()


async def two_bodies(item: Item, other: Item) -> Response:
    return Response()


async def embedded(item: Annotated[Item, Body(embed=True)]) -> Response:
    return Response()


async def with_path(item: Item, key: str) -> Response:
    return Response()


async def a_dict(item: dict[str, Any]) -> Response:
    return Response()


def synchronous(item: Item) -> Response:
    return Response()


async def a_document(item: Item) -> dict[str, Any]:
    return {}


def route(endpoint: Callable[..., Any], path: str = "/items") -> APIRoute:
    return APIRoute(path, endpoint, methods=["POST"])


def test_direct_body_of_a_body_only_route() -> None:
    found = direct_body(route(with_request))
    assert isinstance(found, DirectBody)
    assert found.field.name == "item" and found.request_name == "request"
    assert found.endpoint is with_request
    alone = direct_body(route(body_only))
    assert alone is not None and alone.request_name is None


@pytest.mark.parametrize(
    ("endpoint", "path"),
    [
        (with_query, "/items"),
        (with_dependency, "/items"),
        (two_bodies, "/items"),
        (embedded, "/items"),
        (with_path, "/items/{key}"),
        (a_dict, "/items"),
        (synchronous, "/items"),
        (a_document, "/items"),
    ],
)
def test_no_direct_body_for_other_routes(endpoint: Callable[..., Any], path: str) -> None:
    assert direct_body(route(endpoint, path)) is None


def test_the_route_attributes_read_exist() -> None:
    single = route(body_only)
    assert single._embed_body_fields is False  # its absence would turn the direct way off
    assert route(embedded)._embed_body_fields is True
    assert single.param_convertors == {}
    assert route(with_path, "/items/{key}").param_convertors
    dependant = single.dependant
    for name in (
        "path_params",
        "query_params",
        "header_params",
        "cookie_params",
        "dependencies",
        "body_params",
        "websocket_param_name",
        "http_connection_param_name",
        "response_param_name",
        "background_tasks_param_name",
        "security_scopes_param_name",
        "request_param_name",
        "call",
    ):
        assert hasattr(dependant, name), name
    field = dependant.body_params[0]
    assert field.field_info.annotation is Item and field.name == "item"


def _fastapi_errors(body: Any) -> Any:
    """What FastAPI's own handler answers for this body on a body-only route."""
    app = FastAPI()
    app.add_api_route("/items", with_request, methods=["POST"])
    answer = TestClient(app).post("/items", json=body)
    return answer.status_code, answer.json()


def _request(path: str = "/items") -> Request:
    scope = {"type": "http", "method": "POST", "path": path, "headers": [], "query_string": b""}
    return Request(scope)


@pytest.mark.parametrize("body", [{"count": 2}, {"name": 3, "count": "many"}, [1], "text"])
def test_direct_validation_errors_are_fastapis(body: Any) -> None:
    found = direct_body(route(with_request))
    assert found is not None
    with pytest.raises(RequestValidationError) as raised:
        asyncio.run(found.call(_request(), body))
    status, answer = _fastapi_errors(body)
    assert status == 422 and answer == {"detail": jsonable_encoder(raised.value.errors())}


def test_a_valid_body_reaches_the_endpoint_with_the_request() -> None:
    found = direct_body(route(with_request))
    assert found is not None
    response = asyncio.run(found.call(_request("/here"), {"name": "a"}))
    assert response.body == b'{"name":"a","path":"/here"}'


def test_the_scope_keys_are_those_routing_sets() -> None:
    app = FastAPI()
    seen: dict[str, Any] = {}

    async def endpoint(item: Item, request: Request) -> Response:
        seen.update(request.scope)
        return Response()

    app.add_api_route("/items", endpoint, methods=["POST"])
    assert TestClient(app).post("/items", json={"name": "a"}).status_code == 200
    routed = app.router.routes[-1]
    assert matched_route(seen) is routed
    entered: dict[str, Any] = {}
    assert isinstance(routed, APIRoute)
    enter_route(entered, routed)
    assert matched_route(entered) is routed
    assert entered == {key: seen[key] for key in ("route", "endpoint", "path_params")}
    assert matched_route({}) is None


def test_cached_body_is_the_body_read() -> None:
    async def scenario() -> tuple[bytes | None, bytes | None]:
        async def receive() -> dict[str, Any]:
            return {"type": "http.request", "body": b'{"a": 1}', "more_body": False}

        scope = {"type": "http", "method": "POST", "path": "/", "headers": []}
        request = Request(scope, receive)
        before = cached_body(request)
        await request.body()
        return before, cached_body(request)

    assert asyncio.run(scenario()) == (None, b'{"a": 1}')


def test_fastapis_handler_parses_a_json_body_with_request_json() -> None:
    """StrictJSONRequest (poolserve/http/routing.py) refuses duplicate keys through json()."""
    calls: list[str] = []

    class Counting(Request):
        async def json(self) -> Any:
            calls.append("json")
            return await super().json()

    class CountingRoute(APIRoute):
        def get_route_handler(self) -> Callable[[Request], Any]:
            handler = super().get_route_handler()

            async def counting(request: Request) -> Response:
                return await handler(Counting(request.scope, request.receive))

            return counting

    app = FastAPI()
    app.router.route_class = CountingRoute
    app.add_api_route("/items", body_only, methods=["POST"])
    assert TestClient(app).post("/items", json={"name": "a"}).json() == {"name": "a"}
    assert calls == ["json"]
