"""The route class of every route: strict JSON, parsed and validated once.

Duplicate keys, NaN and non-JSON content types are refused as the rest of the service refuses
bad input (400, never FastAPI's 422); a route whose only inputs are one body model and the
request skips FastAPI's generic dependency solving and validates its body directly.
"""

from __future__ import annotations

import inspect
import json
from collections.abc import Awaitable, Callable, Coroutine
from dataclasses import dataclass
from typing import Any

from fastapi import Request
from fastapi.exceptions import RequestValidationError
from fastapi.routing import APIRoute
from pydantic import BaseModel
from starlette.responses import Response
from starlette.types import Message, Receive, Scope

from poolserve.service.errors import EdgeError, clip


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
    """A route that parses its body with StrictJSONRequest.

    A route whose only inputs are one JSON body model (and the request) has its body parsed and
    validated once, straight into the model, and its endpoint called: FastAPI's dependency
    solving, content-type parsing and per-call bookkeeping cost more than both together. The
    validation is FastAPI's own (the body field's TypeAdapter), its errors raised as FastAPI
    raises them; anything else (another content type, a body that is not JSON or repeats a key,
    a failed read) goes through FastAPI's handler, which answers it as before.
    """

    def get_route_handler(self) -> Callable[[Request], Coroutine[Any, Any, Response]]:
        """FastAPI's handler given the strict request, or the direct one where it applies."""
        handler = super().get_route_handler()
        direct = _direct_body(self)

        async def strict(request: Request) -> Response:
            strict_request = StrictJSONRequest(request.scope, request.receive)
            if direct is None or not _json_typed(request.scope):
                return await handler(strict_request)
            return await direct.call(strict_request, handler)

        return strict


def _json_typed(scope: Scope) -> bool:
    """The request says its body is JSON: `application/json`, with parameters or without."""
    for key, value in scope["headers"]:
        if key == b"content-type":
            return value == b"application/json" or value.startswith(b"application/json;")
    return False


@dataclass(frozen=True)
class DirectBody:
    """How one JSON body model reaches its endpoint without FastAPI's dependency solving."""

    field: Any  # FastAPI's ModelField of the body parameter
    endpoint: Callable[..., Awaitable[Response]]
    request_name: str | None

    async def call(
        self, request: StrictJSONRequest, fallback: Callable[[Request], Awaitable[Response]]
    ) -> Response:
        """Parse and validate the body once, then run the endpoint; odd bodies to `fallback`."""
        try:
            document = await request.json()
        except Exception as exc:  # FastAPI's handler answers it, from the same read or error
            if hasattr(request, "_body"):
                return await fallback(request)
            return await fallback(StrictJSONRequest(request.scope, _raises(exc)))
        value, errors = self.field.validate(document, {}, loc=("body",))
        if errors:
            raise RequestValidationError(errors, body=document)
        arguments = {self.field.name: value}
        if self.request_name is not None:
            arguments[self.request_name] = request
        return await self.endpoint(**arguments)


def _raises(exc: Exception) -> Receive:
    """A receive that fails as the first read of the body did."""

    async def receive() -> Message:
        raise exc

    return receive


def _direct_body(route: APIRoute) -> DirectBody | None:
    """The route's body model and endpoint when they are all it takes and it answers a Response."""
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
    return DirectBody(field, call, dependant.request_param_name)
