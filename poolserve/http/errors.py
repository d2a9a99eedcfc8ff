"""Domain errors mapped to HTTP in one table, rendered as OpenAI-style error bodies (TEI's on
TEI's routes)."""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import orjson
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.responses import Response

from poolserve.types.errors import (
    APIError,
    DrainingError,
    EmptyPromptError,
    EngineDeadError,
    InvalidPoolingParamsError,
    InvalidTokenIdError,
    InvalidTokenTypeError,
    KeyRateLimitedError,
    LoraAdapterNotFoundError,
    ModelError,
    OverloadedError,
    PoolingError,
    PromptTooLongError,
    RequestTooLargeError,
    StepFailedError,
    UnsupportedTaskError,
    clip,
)

logger = logging.getLogger(__name__)

MAX_MESSAGE_CHARS = 1024
CLOSE = {"connection": "close"}  # the rest of the request was not read: the connection is spent
# Where a route marks the client family whose error body it answers with (the request's scope
# state); unmarked routes answer OpenAI's.
ERROR_FAMILY_KEY = "poolserve.error_family"
TEI_FAMILY = "tei"
OLLAMA_FAMILY = "ollama"
# Voyage's client posts to OpenAI's path and reads its errors from `{"detail": message}`
# (voyageai 0.5, api_requestor.handle_error_response); /v1/embeddings marks its requests.
VOYAGE_FAMILY = "voyage"


class EdgeError(StarletteHTTPException):
    """A problem with the HTTP framing (body size or time, JSON keys) found while reading it.

    An HTTPException, so FastAPI's body parsing lets it through unchanged.
    """

    def __init__(
        self, status: int, message: str, code: str, headers: Mapping[str, str] | None = None
    ) -> None:
        super().__init__(status, message, dict(headers) if headers else None)
        self.code = code


@dataclass(frozen=True)
class ErrorShape:
    """How one domain error class looks over HTTP."""

    status: int
    type: str
    code: str
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
    PoolingError: ErrorShape(400, "invalid_request_error", "invalid_parameter", _none),
    PromptTooLongError: ErrorShape(400, "invalid_request_error", "context_length_exceeded", _input),
    RequestTooLargeError: ErrorShape(400, "invalid_request_error", "request_too_large", _input),
    EmptyPromptError: ErrorShape(400, "invalid_request_error", "empty_prompt", _input),
    InvalidTokenTypeError: ErrorShape(400, "invalid_request_error", "invalid_token_type", _input),
    InvalidTokenIdError: ErrorShape(400, "invalid_request_error", "invalid_token_id", _input),
    LoraAdapterNotFoundError: ErrorShape(
        404, "invalid_request_error", "model_not_found", lambda e: "lora_name"
    ),
    ModelError: ErrorShape(400, "invalid_request_error", "invalid_request", _none),
    OverloadedError: ErrorShape(429, "rate_limit_error", "overloaded", _none),
    DrainingError: ErrorShape(503, "service_unavailable", "draining", _none),
    EngineDeadError: ErrorShape(503, "service_unavailable", "engine_dead", _none),
    StepFailedError: ErrorShape(500, "internal_error", "step_failed", _none),
}

# Codes for errors Starlette and FastAPI raise themselves (routing, unreadable bodies).
HTTP_CODES = {
    400: "invalid_request",
    404: "not_found",
    405: "method_not_allowed",
    408: "body_timeout",
    413: "payload_too_large",
}
INTERNAL = ErrorShape(500, "internal_error", "internal_error", _none)

# TEI's `ErrorType` and the status it maps each to (router/src/lib.rs, server.rs, TEI 1.9.3): our
# code first, then our status; anything else keeps its status as a Validation (4xx) or Backend
TEI_BY_CODE: dict[str, tuple[int, str]] = {
    "empty": (400, "Empty"),  # TEI's one 400: an empty batch, text or id list
    "duplicate_key": (422, "Validation"),  # serde refuses a duplicate field as a data error
    "unsupported_task": (424, "Backend"),  # "Model is not an embedding model" and the like
    "step_failed": (424, "Backend"),
}
TEI_BY_STATUS: dict[int, tuple[int, str]] = {
    400: (422, "Validation"),  # too-long inputs and batch sizes included
    429: (429, "Overloaded"),
    503: (503, "Unhealthy"),
}


def error_document(
    message: str, type_: str, param: str | None, code: str
) -> dict[str, dict[str, str | None]]:
    """The OpenAI-style error object, with echoed text bounded."""
    param = None if param is None else clip(param)
    return {
        "error": {
            "message": clip(message, MAX_MESSAGE_CHARS),
            "type": type_,
            "param": param,
            "code": code,
        }
    }


def error_response(
    status: int,
    message: str,
    type_: str,
    param: str | None,
    code: str,
    headers: Mapping[str, str] | None = None,
) -> Response:
    """An OpenAI-style error body."""
    body = orjson.dumps(error_document(message, type_, param, code))
    return Response(body, status_code=status, media_type="application/json", headers=headers)


def shape_of(exc: Exception) -> tuple[ErrorShape, str]:
    """The HTTP shape of an exception and its message (500 without details for the unknown)."""
    if isinstance(exc, APIError):
        return ErrorShape(exc.status, exc.type, exc.code, lambda _: exc.param), exc.message
    for cls in type(exc).__mro__:
        shape = ERROR_TABLE.get(cls)
        if shape is not None:
            return shape, str(exc)
    logger.error("unhandled error", exc_info=exc)
    return INTERNAL, "internal server error"


def tei_error_response(
    status: int, error_type: str, message: str, headers: Mapping[str, str] | None = None
) -> Response:
    """TEI's error body, `{"error", "error_type"}`, with echoed text bounded."""
    body = orjson.dumps({"error": clip(message, MAX_MESSAGE_CHARS), "error_type": error_type})
    return Response(body, status_code=status, media_type="application/json", headers=headers)


# the families whose error body is one key holding the message
MESSAGE_KEYS: dict[str, str] = {OLLAMA_FAMILY: "error", VOYAGE_FAMILY: "detail"}


def family_error_response(
    family: str | None,
    status: int,
    message: str,
    type_: str,
    param: str | None,
    code: str,
    headers: Mapping[str, str] | None = None,
) -> Response:
    """The error body of the route's client family: TEI's on TEI's routes, Ollama's on
    Ollama's (`{"error": message}`) and Voyage's for its client (`{"detail": message}`), the
    status unchanged, else OpenAI's."""
    if family in MESSAGE_KEYS:
        body = orjson.dumps({MESSAGE_KEYS[family]: clip(message, MAX_MESSAGE_CHARS)})
        return Response(body, status_code=status, media_type="application/json", headers=headers)
    if family != TEI_FAMILY:
        return error_response(status, message, type_, param, code, headers)
    fallback = (status, "Backend" if status >= 500 else "Validation")
    tei_status, error_type = TEI_BY_CODE.get(code) or TEI_BY_STATUS.get(status, fallback)
    return tei_error_response(tei_status, error_type, message, headers)


def response_for(
    exc: Exception, headers: Mapping[str, str] | None = None, family: str | None = None
) -> Response:
    """Map any exception to its HTTP response (in `family`'s shape, OpenAI's by default)."""
    shape, message = shape_of(exc)
    extra = {**(_retry_after(exc) or {}), **(headers or {})}
    return family_error_response(
        family, shape.status, message, shape.type, shape.param(exc), shape.code, extra or None
    )


def error_line(exc: Exception) -> bytes:
    """The last line of an NDJSON stream that an error ended."""
    shape, message = shape_of(exc)
    return orjson.dumps(error_document(message, shape.type, shape.param(exc), shape.code)) + b"\n"


def retry_after_s(exc: Exception) -> int | None:
    """The whole seconds a refusal asks the client to wait (HTTP's Retry-After), or None."""
    if isinstance(exc, OverloadedError):
        return max(1, round(exc.retry_after_s))
    if isinstance(exc, KeyRateLimitedError):  # never sooner than the key's bucket allows
        return max(1, math.ceil(exc.retry_after_s))
    return None


def _retry_after(exc: Exception) -> dict[str, str] | None:
    seconds = retry_after_s(exc)
    return None if seconds is None else {"Retry-After": str(seconds)}


def http_error_response(exc: StarletteHTTPException, family: str | None = None) -> Response:
    """Routing and framing errors, with their headers (Allow on 405, Connection on 408/413)."""
    code = exc.code if isinstance(exc, EdgeError) else HTTP_CODES.get(exc.status_code, "http_error")
    return family_error_response(
        family, exc.status_code, str(exc.detail), "invalid_request_error", None, code, exc.headers
    )
