"""Error handlers and the OpenAPI rewrite: every error through the one table, 400 never 422
(TEI's routes answer TEI's error body and statuses: `ERROR_FAMILY_KEY`)."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.openapi.utils import get_openapi
from pydantic import BaseModel
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.responses import Response
from starlette.types import Scope

from poolserve.http.errors import (
    ERROR_FAMILY_KEY,
    TEI_FAMILY,
    family_error_response,
    http_error_response,
    response_for,
    tei_error_response,
)
from poolserve.types.errors import APIError, ModelError, PoolingError, SchedulerError, clip


def _validation_response(exc: RequestValidationError, family: str | None) -> Response:
    """First pydantic problem, naming the field (client-sent names are clipped)."""
    first = exc.errors()[0] if exc.errors() else {"loc": (), "msg": "invalid request"}
    loc = [clip(str(p)) for p in first.get("loc", ()) if p != "body"]
    param = loc[0] if loc else None
    where = ".".join(loc)
    message = f"{where}: {first['msg']}" if where else str(first["msg"])
    if first.get("type") in ("literal_error", "enum"):  # name the value sent, as vLLM's does
        message += f", got {clip(repr(first.get('input')))}"
    if first.get("type") == "json_invalid":
        message, param = "the request body is not valid JSON", None
        if family == TEI_FAMILY:  # TEI's axum: 400 for JSON syntax, 422 for a body off its schema
            return tei_error_response(400, "Validation", message)
    return family_error_response(
        family, 400, message, "invalid_request_error", param, "invalid_parameter"
    )


def family_of(scope: Scope) -> str | None:
    """The client family a route marked its request with (None: OpenAI's error body)."""
    family = scope.get("state", {}).get(ERROR_FAMILY_KEY)
    return family if isinstance(family, str) else None


def error_answer(exc: Exception, scope: Scope) -> Response:
    """The one table's answer to any error, in the shape of the family the request was marked
    with: what the app's handlers answer, and the edge for what reaches it unanswered."""
    family = family_of(scope)
    if isinstance(exc, RequestValidationError):
        return _validation_response(exc, family)
    if isinstance(exc, StarletteHTTPException):
        return http_error_response(exc, family)
    return response_for(exc, family=family)


def install_error_handlers(app: FastAPI) -> None:
    """Route every error through the table above."""

    async def on_error(request: Request, exc: Exception) -> Response:
        return error_answer(exc, request.scope)

    classes = (RequestValidationError, StarletteHTTPException)
    for error_class in (*classes, APIError, ModelError, PoolingError, SchedulerError):
        app.add_exception_handler(error_class, on_error)
    app.add_exception_handler(Exception, on_error)  # last resort: 500 with no details


class ErrorInfo(BaseModel):
    """The object inside every error body."""

    message: str
    type: str
    param: str | None
    code: str


class ErrorBody(BaseModel):
    """Every 4xx and 5xx body: `{"error": {...}}`."""

    error: ErrorInfo


class TEIErrorBody(BaseModel):
    """TEI's error body, on TEI's routes (TEI's `ErrorResponse`)."""

    error: str
    error_type: str


class OllamaErrorBody(BaseModel):
    """Ollama's error body, on Ollama's routes (`gin.H{"error": ...}`)."""

    error: str


class VoyageErrorBody(BaseModel):
    """Voyage's error body, to a request in Voyage's shape (FastAPI's `{"detail": ...}`)."""

    detail: str


# What each status means, for the schema; which apply depends on the operation.
ERROR_DOCS = {
    400: "Invalid request: malformed JSON, wrong field, duplicate key or header.",
    401: "Missing or wrong API key (only with --api-key).",
    404: "Unknown `model`.",
    408: "The request body did not arrive within --body-timeout.",
    413: "Request body above --payload-limit.",
    422: "TEI's routes: a body off TEI's schema or an input TEI refuses (TEI's Validation).",
    424: "TEI's routes: the model cannot serve this (TEI's Backend).",
    429: "Overloaded; retry after `Retry-After` seconds.",
    503: "Not ready, draining, engine stopped, or shut down before the answer.",
}
BODY_ERRORS = (400, 401, 404, 408, 413, 429, 503)
TEI_ERRORS = (422, 424)  # besides BODY_ERRORS, on paths where TEI's bodies are served
GET_ERRORS = (401, 503)
OPENAI_BODY = {"$ref": "#/components/schemas/ErrorBody"}
# on TEI's paths the edge's own refusals (401, 408, 413) keep the OpenAI body
EITHER_BODY = {"anyOf": [OPENAI_BODY, {"$ref": "#/components/schemas/TEIErrorBody"}]}
# likewise on Ollama's paths: its body, or the edge's OpenAI one
OLLAMA_BODY = {"anyOf": [OPENAI_BODY, {"$ref": "#/components/schemas/OllamaErrorBody"}]}
# and on the path Voyage's client posts to, Voyage's body to its requests
VOYAGE_BODY = {"anyOf": [OPENAI_BODY, {"$ref": "#/components/schemas/VoyageErrorBody"}]}


def openapi_schema(
    app: FastAPI,
    open_paths: Iterable[str],
    tei_paths: Iterable[str],
    ollama_paths: Iterable[str] = (),
    voyage_paths: Iterable[str] = (),
) -> dict[str, Any]:
    """FastAPI's schema, with each operation's errors documented as sent: 400, never 422, but
    on paths that serve TEI's bodies, where TEI's errors and statuses apply too; Ollama's paths
    answer its own body, and Voyage's path Voyage's to its requests."""
    if app.openapi_schema is None:
        schema = get_openapi(title=app.title, version=app.version, routes=app.routes)
        components = schema.setdefault("components", {}).setdefault("schemas", {})
        for unused in ("HTTPValidationError", "ValidationError"):
            components.pop(unused, None)
        body = ErrorBody.model_json_schema(ref_template="#/components/schemas/{model}")
        components.update(body.pop("$defs", {}))
        components["ErrorBody"] = body
        components["TEIErrorBody"] = TEIErrorBody.model_json_schema()
        components["OllamaErrorBody"] = OllamaErrorBody.model_json_schema()
        components["VoyageErrorBody"] = VoyageErrorBody.model_json_schema()
        is_open, is_tei = set(open_paths), set(tei_paths)
        shapes = {path: OLLAMA_BODY for path in ollama_paths}
        shapes.update({path: VOYAGE_BODY for path in voyage_paths})
        shapes.update({path: EITHER_BODY for path in is_tei})
        for path, item in schema.get("paths", {}).items():
            shape: dict[str, Any] = shapes.get(path, OPENAI_BODY)
            for operation in item.values():
                _document_errors(operation, path in is_open, path in is_tei, shape)
        app.openapi_schema = schema
    return app.openapi_schema


def _document_errors(
    operation: dict[str, Any], is_open: bool, is_tei: bool, body: dict[str, Any]
) -> None:
    """Replace FastAPI's 422 by the statuses this operation can answer with."""
    responses = operation.setdefault("responses", {})
    responses.pop("422", None)
    statuses: tuple[int, ...] = ()
    if "requestBody" in operation:
        statuses = BODY_ERRORS + (TEI_ERRORS if is_tei else ())
    elif not is_open:
        statuses = GET_ERRORS
    declared = [int(s) for s in responses if s.isdigit() and int(s) >= 400]
    for status in sorted({*statuses, *declared}):
        responses[str(status)] = {
            "description": responses.get(str(status), {}).get("description") or ERROR_DOCS[status],
            "content": {"application/json": {"schema": body}},
        }
