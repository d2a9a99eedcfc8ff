"""Domain errors mapped to HTTP in one table, rendered as OpenAI-style error bodies."""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass

import orjson
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.responses import Response

from models.errors import InvalidTokenIdError, ModelError
from pooling.errors import InvalidPoolingParamsError, PoolingError, UnsupportedTaskError
from scheduler.errors import (
    DrainingError,
    EmptyPromptError,
    EngineDeadError,
    OverloadedError,
    PromptTooLongError,
    RequestTooLargeError,
    SchedulerError,
    StepFailedError,
)

logger = logging.getLogger(__name__)


class APIError(Exception):
    """An error raised by the service layer itself, already carrying its HTTP shape."""

    status = 400
    type = "invalid_request_error"
    code: str | None = None

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.param = param


class InvalidRequestError(APIError):
    """Bad input (400)."""


class AuthenticationError(APIError):
    """Missing or wrong API key (401)."""

    status, type, code = 401, "authentication_error", "invalid_api_key"


class ModelNotFoundError(APIError):
    """Unknown `model` name (404)."""

    status, type, code = 404, "not_found_error", "model_not_found"


class PayloadTooLargeError(APIError):
    """Request body above --payload-limit (413)."""

    status, type, code = 413, "invalid_request_error", "payload_too_large"


class NotReadyError(APIError):
    """The server is still warming up (503)."""

    status, type, code = 503, "service_unavailable", "not_ready"


@dataclass(frozen=True)
class ErrorShape:
    """How one domain error class looks over HTTP."""

    status: int
    type: str
    code: str | None
    param: Callable[[Exception], str | None]


def _none(_: Exception) -> str | None:
    return None


def _input(_: Exception) -> str | None:
    return "input"


# Most specific classes first: lookup walks the exception's MRO.
ERROR_TABLE: dict[type[Exception], ErrorShape] = {
    UnsupportedTaskError: ErrorShape(
        400, "invalid_request_error", "unsupported_task", lambda e: "task"
    ),
    InvalidPoolingParamsError: ErrorShape(
        400, "invalid_request_error", "invalid_parameter", lambda e: getattr(e, "param_name", None)
    ),
    PoolingError: ErrorShape(400, "invalid_request_error", None, _none),
    PromptTooLongError: ErrorShape(400, "invalid_request_error", "context_length_exceeded", _input),
    RequestTooLargeError: ErrorShape(400, "invalid_request_error", "request_too_large", _input),
    EmptyPromptError: ErrorShape(400, "invalid_request_error", "empty_prompt", _input),
    InvalidTokenIdError: ErrorShape(400, "invalid_request_error", "invalid_token_id", _input),
    ModelError: ErrorShape(400, "invalid_request_error", None, _none),
    OverloadedError: ErrorShape(429, "rate_limit_error", "overloaded", _none),
    DrainingError: ErrorShape(503, "service_unavailable", "draining", _none),
    EngineDeadError: ErrorShape(503, "service_unavailable", "engine_dead", _none),
    StepFailedError: ErrorShape(500, "internal_error", "step_failed", _none),
}


# Codes for errors Starlette raises itself (routing, body limit).
HTTP_CODES = {404: "not_found", 405: "method_not_allowed", 413: "payload_too_large"}


def error_response(
    status: int,
    message: str,
    type_: str,
    param: str | None,
    code: str | None,
    headers: dict[str, str] | None = None,
) -> Response:
    """An OpenAI-style error body."""
    body = {"error": {"message": message, "type": type_, "param": param, "code": code}}
    return Response(
        orjson.dumps(body), status_code=status, media_type="application/json", headers=headers
    )


def response_for(exc: Exception) -> Response:
    """Map any exception to its HTTP response (500 without details for the unknown)."""
    if isinstance(exc, APIError):
        return error_response(exc.status, exc.message, exc.type, exc.param, exc.code)
    for cls in type(exc).__mro__:
        shape = ERROR_TABLE.get(cls)
        if shape is not None:
            headers = _retry_after(exc)
            return error_response(
                shape.status, str(exc), shape.type, shape.param(exc), shape.code, headers
            )
    logger.error("unhandled error", exc_info=exc)
    return error_response(500, "internal server error", "internal_error", None, None)


def _retry_after(exc: Exception) -> dict[str, str] | None:
    if isinstance(exc, OverloadedError):
        return {"Retry-After": str(max(1, round(exc.retry_after_s)))}
    return None


def _validation_response(exc: RequestValidationError) -> Response:
    """First pydantic problem, naming the field."""
    first = exc.errors()[0] if exc.errors() else {"loc": (), "msg": "invalid request"}
    loc = [str(p) for p in first.get("loc", ()) if p != "body"]
    param = loc[0] if loc else None
    where = ".".join(loc)
    message = f"{where}: {first['msg']}" if where else str(first["msg"])
    if first.get("type") == "json_invalid":
        message, param = "the request body is not valid JSON", None
    return error_response(400, message, "invalid_request_error", param, "invalid_parameter")


def install_error_handlers(app: FastAPI) -> None:
    """Route every error through the table above."""

    async def on_validation(_: Request, exc: Exception) -> Response:
        assert isinstance(exc, RequestValidationError)
        return _validation_response(exc)

    async def on_http(_: Request, exc: Exception) -> Response:
        assert isinstance(exc, StarletteHTTPException)
        code = HTTP_CODES.get(exc.status_code)
        return error_response(exc.status_code, str(exc.detail), "invalid_request_error", None, code)

    async def on_any(_: Request, exc: Exception) -> Response:
        return response_for(exc)

    app.add_exception_handler(RequestValidationError, on_validation)
    app.add_exception_handler(StarletteHTTPException, on_http)
    for domain_error in (APIError, ModelError, PoolingError, SchedulerError):
        app.add_exception_handler(domain_error, on_any)
    app.add_exception_handler(Exception, on_any)  # last resort: 500 with no details
