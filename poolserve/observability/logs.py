"""Log setup (text lines or one JSON object per line) and the per-request access log."""

from __future__ import annotations

import logging
import sys
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Any, Literal

import orjson

from poolserve.types.errors import ModelError, ModelStartError, clip, command_error

if TYPE_CHECKING:  # the front end's ASGI scope; the supervisor logs without starlette
    from starlette.types import Scope

LogFormat = Literal["text", "json"]
ACCESS_LOGGER = "poolserve.access"
TEXT_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"
# How today's disconnect line reads; the access line of a 499 says the same.
CLIENT_CLOSED_TEXT = "client closed the connection before its answer"
CLIENT_CLOSED = 499  # nginx's status for a client that left before its answer
# Where a route notes its request's admitted prompt tokens in the ASGI scope's state.
PROMPT_TOKENS_KEY = "prompt_tokens"
# Where the pipeline notes the served name of the model a request was routed to...
MODEL_KEY = "model"
# ...and the LoRA adapter it runs through, when it names one (MODEL_KEY is then its base's).
LORA_KEY = "lora_name"
# Where the edge notes the name of the API key a request came with (--api-keys-file): what
# later features scope a tenant's resources by (`request.state.api_key_name`).
API_KEY_NAME_KEY = "api_key_name"
# Attribute of a LogRecord that carries structured fields (set through `extra`).
FIELDS_ATTR = "poolserve_fields"


@dataclass(frozen=True)
class AccessRecord:
    """One answered (or abandoned) HTTP request, as the access log reports it."""

    method: str
    path: str
    route: str  # the route's template, or "unmatched"
    status: int
    duration_ms: float
    model: str | None  # the served name of the model it was routed to; None: no model
    prompt_tokens: int | None  # None: the request tokenized nothing
    request_id: str
    client: str | None
    trace_id: str | None  # set when the request was traced
    # the LoRA adapter the request ran through (`model` is its base); None: none
    lora_name: str | None = None
    # the name of the API key it came with (--api-keys-file); None: no keys file
    key: str | None = None

    def message(self) -> str:
        """The text line: what the JSON form carries as separate keys."""
        lora = "" if self.lora_name is None else f"lora_name={self.lora_name} "
        key = "" if self.key is None else f"key={self.key} "
        text = (
            f"{self.method} {self.path} {self.status} {self.duration_ms:.1f}ms "
            f"route={self.route} model={_or_dash(self.model)} {lora}"
            f"prompt_tokens={_or_dash(self.prompt_tokens)} {key}"
            f"request_id={self.request_id} client={_or_dash(self.client)}"
        )
        if self.trace_id is not None:
            text += f" trace_id={self.trace_id}"
        if self.status == CLIENT_CLOSED:
            text += f" ({CLIENT_CLOSED_TEXT})"
        return text

    def fields(self) -> dict[str, object]:
        """The JSON form's keys; `lora_name` only on a request that ran through an adapter and
        `key` only on one that came with a keys file's key, so every other line keeps the keys
        it always had."""
        fields = dict(vars(self))
        if self.lora_name is None:
            del fields["lora_name"]
        if self.key is None:
            del fields["key"]
        return fields


def access_record(
    scope: Scope,
    route: str,
    status: int,
    duration_s: float,
    request_id: str,
    trace_id: str | None,
) -> AccessRecord:
    """What the access log says about one request; its model, LoRA adapter and prompt tokens as
    the pipeline noted them, its API key's name as the edge did."""
    client = scope.get("client")
    # the path as sent: decoded, a %0A could break the line
    raw = scope.get("raw_path")
    path = raw.decode("latin-1") if isinstance(raw, bytes) else str(scope.get("path", ""))
    noted = scope.get("state", {})
    prompt_tokens = noted.get(PROMPT_TOKENS_KEY)
    model = noted.get(MODEL_KEY)
    lora = noted.get(LORA_KEY)
    key = noted.get(API_KEY_NAME_KEY)
    return AccessRecord(
        method=str(scope.get("method", "")),
        path=clip(path),
        route=route,
        status=status,
        duration_ms=round(duration_s * 1000, 3),
        model=model if isinstance(model, str) else None,
        prompt_tokens=prompt_tokens if isinstance(prompt_tokens, int) else None,
        request_id=request_id,
        client=str(client[0]) if client else None,
        trace_id=trace_id,
        lora_name=lora if isinstance(lora, str) else None,
        key=key if isinstance(key, str) else None,
    )


def _or_dash(value: object) -> str:
    return "-" if value is None else str(value)


def log_access(logger: logging.Logger, record: AccessRecord, level: int) -> None:
    """Emit one access line; the JSON formatter spreads its fields as keys."""
    if logger.isEnabledFor(level):
        # the record logger.log(level, "%s", ...) makes, its caller (this function) named once
        # instead of found by a walk up the stack: a quarter of a line's cost, once per request
        line = logger.makeRecord(
            logger.name,
            level,
            _ACCESS_SOURCE[0],
            _ACCESS_SOURCE[1],
            "%s",
            (record.message(),),
            None,
            _ACCESS_SOURCE[2],
            {FIELDS_ATTR: record.fields()},
        )
        logger.handle(line)


_ACCESS_SOURCE = (
    log_access.__code__.co_filename,
    log_access.__code__.co_firstlineno,
    log_access.__code__.co_name,
)


class JSONFormatter(logging.Formatter):
    """One JSON object per record: time, level, logger, message, then any structured fields."""

    def format(self, record: logging.LogRecord) -> str:
        """The record as a single line of JSON."""
        document: dict[str, Any] = {
            "time": datetime.fromtimestamp(record.created, UTC).isoformat(timespec="milliseconds"),
            "level": record.levelname,
            "logger": record.name,
            "message": record.getMessage(),
        }
        fields = getattr(record, FIELDS_ATTR, None)
        if isinstance(fields, dict):
            document.update(fields)
        if record.exc_info:
            document["exception"] = self.formatException(record.exc_info)
        if record.stack_info:
            document["stack"] = self.formatStack(record.stack_info)
        return orjson.dumps(document, default=str).decode()


FORMATTERS: dict[LogFormat, Callable[[], logging.Formatter]] = {
    "text": lambda: logging.Formatter(TEXT_FORMAT),
    "json": JSONFormatter,
}


def configure_logging(level: str, log_format: LogFormat) -> None:
    """One stderr handler on the root logger; uvicorn's loggers propagate to it."""
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(FORMATTERS[log_format]())
    root = logging.getLogger()
    for existing in list(root.handlers):
        root.removeHandler(existing)
    root.addHandler(handler)
    root.setLevel(level.upper())
    logging.captureWarnings(True)  # warnings.warn text becomes records too (JSON when asked)


# Start failures that are the operator's to fix (a path, a flag, a file, a precision): one line,
# the traceback only at --log-level debug. Anything else is a bug and keeps its traceback.
OPERATOR_ERRORS: tuple[type[Exception], ...] = (ModelError, ValueError, OSError)


def report_start_failure(command: str, exc: BaseException) -> None:
    """Say why the server cannot start in one line on stderr, `poolserve CMD: error: ...`, as
    argparse says a usage error (a traceback too, logged, at --log-level debug or for a bug)."""
    cause = exc.__cause__ if isinstance(exc, ModelStartError) else exc
    if not isinstance(cause, OPERATOR_ERRORS):
        logging.getLogger(__name__).error("start failed", exc_info=exc)
    elif logging.getLogger().isEnabledFor(logging.DEBUG):
        logging.getLogger(__name__).debug("start failed", exc_info=exc)
    command_error(command, str(exc))
