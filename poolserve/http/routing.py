"""The route class of every route (strict JSON, parsed and validated once) and the direct way
to the body-only ones.

Duplicate keys, NaN and non-JSON content types are refused as the rest of the service refuses
bad input (400, never FastAPI's 422); a POST to a route whose only inputs are one body model and
the request skips Starlette's routing and FastAPI's request handling (`DirectRoutes`).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Coroutine, Iterable
from typing import Any, ClassVar

from fastapi import Request
from fastapi.routing import APIRoute
from starlette.responses import Response
from starlette.routing import BaseRoute
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from poolserve.http.errors import ERROR_FAMILY_KEY, EdgeError
from poolserve.http.internals import DirectBody, cached_body, direct_body, enter_route
from poolserve.types.errors import clip


def _refuse_duplicate_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    """object_pairs_hook: a key given twice is an error, not last-wins."""
    document = dict(pairs)
    if len(document) != len(pairs):  # rare: only then look for the repeated key
        seen: set[str] = set()
        for key, _ in pairs:
            if key in seen:
                message = f"duplicate key {clip(key)!r} in the JSON body"
                raise EdgeError(400, message, "duplicate_key")
            seen.add(key)
    return document


class StrictJSONRequest(Request):
    """A request whose JSON body refuses duplicate object keys."""

    async def json(self) -> Any:
        """The parsed body; the hook costs one dict per JSON object, not a second parse."""
        if not hasattr(self, "_json"):
            self._json = json.loads(await self.body(), object_pairs_hook=_refuse_duplicate_keys)
        return self._json


class StrictJSONRoute(APIRoute):
    """A route that parses its body with StrictJSONRequest, its errors in `error_family`'s shape.

    Its JSON POSTs are normally answered by `DirectRoutes` before Starlette's routing (see there);
    this handler is FastAPI's, for what they leave to the app.
    """

    error_family: ClassVar[str | None] = None  # None: OpenAI's error body

    def get_route_handler(self) -> Callable[[Request], Coroutine[Any, Any, Response]]:
        """FastAPI's handler given the strict request, marked with the route's error family."""
        handler = super().get_route_handler()
        family = self.error_family

        async def strict(request: Request) -> Response:
            if family is not None:  # before the body is read: its errors take the shape too
                request.scope.setdefault("state", {})[ERROR_FAMILY_KEY] = family
            return await handler(StrictJSONRequest(request.scope, request.receive))

        return strict


def _json_typed(scope: Scope) -> bool:
    """The request says its body is JSON: `application/json`, with parameters or without."""
    for key, value in scope["headers"]:
        if key == b"content-type":
            return value == b"application/json" or value.startswith(b"application/json;")
    return False


class DirectRoutes:
    """Pure ASGI, just inside the edge: the JSON POSTs of body-only routes, answered directly.

    A route whose only inputs are one JSON body model (and the request) and that answers a
    Response needs none of what sits between the edge and its endpoint: Starlette's route
    matching, FastAPI's request handling with its two exit stacks and exception wrapper,
    dependency solving and content-type parsing cost more per request than parsing and
    validating the body. Such a request has its body parsed once (strict JSON), validated by the
    route's own body field and its endpoint called; its errors propagate to the edge, which
    answers them with the app's one error table in the route's error family. Everything else
    (another path, method or content type) goes on to the app, and so does a body that is not
    strict JSON, replayed, so that FastAPI's handler answers it exactly as it always has.
    """

    def __init__(self, app: ASGIApp, *, routes: Iterable[BaseRoute]) -> None:
        self.app = app
        self.direct = {
            body.route.path: body for body in map(_direct_body, routes) if body is not None
        }

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        body = None
        if scope["type"] == "http" and scope["method"] == "POST" and _json_typed(scope):
            body = self.direct.get(route_path(scope))
        if body is None:
            await self.app(scope, receive, send)
            return
        route = body.route
        enter_route(scope, route)
        if route.error_family is not None:
            scope.setdefault("state", {})[ERROR_FAMILY_KEY] = route.error_family
        request = StrictJSONRequest(scope, receive)
        try:
            document = await request.json()
        except Exception as exc:  # FastAPI's handler answers it, from the same read or error
            await self.app(scope, _replay(request, exc, receive), send)
            return
        response = await body.call(request, document)
        await response(scope, receive, send)


def route_path(scope: Scope) -> str:
    """The request's path without the --root-path prefix, if it came with it."""
    path: str = scope["path"]
    root: str = scope.get("root_path") or ""
    if root and path.startswith(root + "/"):
        return path[len(root) :]
    return path


def _replay(request: Request, exc: Exception, receive: Receive) -> Receive:
    """A receive that gives the body read once (then the connection's own messages), or fails
    as that read did."""
    body = cached_body(request)
    if body is None:

        async def failing() -> Message:
            raise exc

        return failing
    pending: list[Message] = [{"type": "http.request", "body": body, "more_body": False}]

    async def replayed() -> Message:
        return pending.pop() if pending else await receive()

    return replayed


def _direct_body(route: BaseRoute) -> DirectBody[StrictJSONRoute] | None:
    """A strict route's body model and endpoint: a POST with no path parameters, whose body
    model (and the request) is all it takes, answering a Response."""
    if not isinstance(route, StrictJSONRoute) or route.methods != {"POST"}:
        return None
    return direct_body(route)
