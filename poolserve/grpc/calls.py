"""A gRPC call's side of the front end's pipeline: its `Caller` (model, trace, access-log fields),
its API key and model from the metadata, its accounting in the request metrics and the access
log, and the one table that turns the project's errors into gRPC status codes.

Every request message is accounted as one request, as an HTTP request is: a stream's messages
each count once, under the stream's method path as the endpoint and `grpc` as the protocol.
With --api-keys-file each message is also one request of its key (its route the method path,
its requests-per-second bucket taking one), so a stream whose key's bucket runs dry ends at the
message that found it empty.
"""

from __future__ import annotations

import hmac
import logging
import time
from collections.abc import Callable, Mapping
from typing import Any

import grpc

from poolserve.frontend.state import ServiceState
from poolserve.http.errors import retry_after_s, shape_of
from poolserve.http.tenants import TenantKey, served_names
from poolserve.observability.logs import (
    ACCESS_LOGGER,
    LORA_KEY,
    MODEL_KEY,
    PROMPT_TOKENS_KEY,
    access_record,
    log_access,
)
from poolserve.observability.metrics import GRPC, NO_LORA, UNROUTED
from poolserve.observability.tracing import LORA_SPAN_ATTRIBUTE, RequestTrace, SpanRecord
from poolserve.types.errors import APIError, AuthenticationError, ClientDisconnectedError
from poolserve.types.tasks import PoolingTask

logger = logging.getLogger(__name__)
ACCESS_LOG = logging.getLogger(ACCESS_LOGGER)

# the metadata key that names the served model (TEI's gRPC API serves one model and has none)
MODEL_METADATA = "model"
MISSING_KEY = "No valid auth token"  # TEI's words for a missing or wrong key
CLIENT_CLOSED = 499

# HTTP statuses of the project's errors -> gRPC codes; TEI's own mapping where TEI has the case
# (its validation errors, 413 included, are INVALID_ARGUMENT; overload RESOURCE_EXHAUSTED)
CODES: dict[int, grpc.StatusCode] = {
    400: grpc.StatusCode.INVALID_ARGUMENT,
    401: grpc.StatusCode.UNAUTHENTICATED,
    403: grpc.StatusCode.PERMISSION_DENIED,
    404: grpc.StatusCode.NOT_FOUND,
    408: grpc.StatusCode.DEADLINE_EXCEEDED,
    413: grpc.StatusCode.INVALID_ARGUMENT,
    422: grpc.StatusCode.INVALID_ARGUMENT,
    429: grpc.StatusCode.RESOURCE_EXHAUSTED,
    499: grpc.StatusCode.CANCELLED,
    503: grpc.StatusCode.UNAVAILABLE,
}
# error codes that TEI answers with a code of their own: a task the model lacks is TEI's
# `Backend` error, FAILED_PRECONDITION
CODES_BY_ERROR: dict[str, grpc.StatusCode] = {
    "unsupported_task": grpc.StatusCode.FAILED_PRECONDITION,
}


# gRPC has no Retry-After: a refusal that says when to come back says it in trailing metadata
RETRY_AFTER_METADATA = "retry-after"
Trailers = tuple[tuple[str, str], ...]


class GrpcError(Exception):
    """An error already in gRPC's terms: the code, the message and the HTTP status it counts as,
    and the trailing metadata it ends the call with."""

    def __init__(
        self, code: grpc.StatusCode, message: str, status: int, trailers: Trailers = ()
    ) -> None:
        super().__init__(message)
        self.code = code
        self.message = message
        self.status = status
        self.trailers = trailers


def grpc_error(exc: Exception) -> GrpcError:
    """The gRPC status of a project error: the HTTP table's status and message, then CODES; the
    seconds of HTTP's Retry-After as `retry-after` trailing metadata."""
    if isinstance(exc, GrpcError):
        return exc
    shape, message = shape_of(exc)
    code = CODES_BY_ERROR.get(shape.code) or CODES.get(shape.status, grpc.StatusCode.INTERNAL)
    seconds = retry_after_s(exc)
    trailers = () if seconds is None else ((RETRY_AFTER_METADATA, str(seconds)),)
    return GrpcError(code, message, shape.status, trailers)


def metadata_of(context: grpc.aio.ServicerContext[Any, Any]) -> dict[str, str]:
    """The call's metadata, first value of each key (binary values left out)."""
    found: dict[str, str] = {}
    for key, value in context.invocation_metadata() or ():
        if isinstance(value, str) and key not in found:
            found[key] = value
    return found


def bearer(metadata: Mapping[str, str]) -> bytes:
    """The key an `authorization: Bearer KEY` metadata carries (empty without one)."""
    given = metadata.get("authorization", "")
    token = given[7:].strip() if given.lower().startswith("bearer ") else ""
    return token.encode("utf-8", "replace")


def check_key(api_key: bytes | None, metadata: Mapping[str, str]) -> None:
    """`authorization: Bearer KEY` as the HTTP edge checks it (constant-time compare)."""
    if api_key is None:
        return
    if not hmac.compare_digest(bearer(metadata), api_key):
        raise AuthenticationError(MISSING_KEY)


class GrpcCall:
    """One request message of a gRPC call: the pipeline's `Caller`, and its accounting."""

    def __init__(
        self, state: ServiceState, method: str, metadata: Mapping[str, str], peer: str
    ) -> None:
        self.state = state
        self.method = method
        self.started = time.monotonic()
        self.model_name: str | None = metadata.get(MODEL_METADATA) or None
        # what the access log and the trace read, in the shape an HTTP request's scope has
        self.scope: dict[str, Any] = {
            "method": "POST",
            "path": method,
            "raw_path": method.encode("latin-1", "replace"),
            "client": _client(peer),
            "state": {},
        }
        self.request_id = metadata.get("x-request-id", "")[:128] or f"{id(self):x}"
        self.trace: RequestTrace = state.tracing.start(
            self.scope, metadata, self.started, self.request_id
        )
        self.task = "none"
        self.tenant: TenantKey | None = None  # its --api-keys-file key, once checked
        state.active_requests += 1  # a drain waits for it, as for an HTTP request

    @property
    def noted(self) -> dict[str, Any]:
        """The access log's fields of this call."""
        noted: dict[str, Any] = self.scope["state"]
        return noted

    def routed(self, model_name: str, lora_name: str | None) -> None:
        """The model in the access log, the metrics and on the trace; PERMISSION_DENIED when the
        call's key may not use it (--api-keys-file's `models`)."""
        self.noted[MODEL_KEY] = model_name
        if lora_name is None:
            self.trace.set({"poolserve.model": model_name})
        else:
            self.noted[LORA_KEY] = lora_name
            self.trace.set({"poolserve.model": model_name, LORA_SPAN_ATTRIBUTE: lora_name})
        tenant = self.tenant
        if tenant is not None and tenant.spec.models is not None:
            tenant.check_model(served_names(self.state, model_name, lora_name))

    def tokenized(self, started: float, ended: float, num_inputs: int, num_tokens: int) -> None:
        """The tokenize span."""
        attributes = {"poolserve.inputs": num_inputs, "poolserve.prompt_tokens": num_tokens}
        self.trace.record(SpanRecord("tokenize", started, ended, attributes))

    def admitted(self, task: PoolingTask, num_tokens: int) -> None:
        """Prompt tokens in the access log, on the trace and charged to the call's key (a call
        may submit two jobs)."""
        total = self.noted.get(PROMPT_TOKENS_KEY, 0) + num_tokens
        self.noted[PROMPT_TOKENS_KEY] = total
        if self.tenant is not None:  # --api-keys-file's tokens_per_minute
            self.tenant.charge(num_tokens)
        self.task = task.value
        self.trace.set({"poolserve.prompt_tokens": total, "poolserve.task": task.value})

    def on_leave(self, callback: Callable[[], None]) -> Callable[[], None]:
        """A gRPC client that leaves cancels the handler's task: the wait ends by cancellation."""
        return _nothing

    def finish(self, status: int, output_bytes: int = 0) -> None:
        """Count the call in the request metrics, the trace and the access log."""
        self.state.active_requests -= 1
        end = time.monotonic()
        model = self.noted.get(MODEL_KEY, UNROUTED)
        lora = self.noted.get(LORA_KEY, NO_LORA)
        metrics = self.state.metrics
        seconds = end - self.started
        metrics.transports[GRPC].add(model, lora, self.method, self.task, status, seconds)
        if output_bytes:
            metrics.add_output_bytes(model, lora, output_bytes)
        self.trace.finish(self.method, status, end)
        if self.state.settings.access_log and ACCESS_LOG.isEnabledFor(logging.INFO):
            record = access_record(
                self.scope,
                self.method,
                status,
                end - self.started,
                self.request_id,
                self.trace.trace_id,
            )
            log_access(ACCESS_LOG, record, logging.INFO)


def status_of(exc: BaseException) -> int:
    """The HTTP status a failed call counts as in the metrics and the access log."""
    if isinstance(exc, GrpcError):
        return exc.status
    if isinstance(exc, APIError):
        return exc.status
    if isinstance(exc, ClientDisconnectedError):
        return CLIENT_CLOSED
    return 500


def _client(peer: str) -> tuple[str, int]:
    """(host, port) of gRPC's peer string (`ipv4:10.0.0.1:5000`, `ipv6:[::1]:5000`)."""
    _, _, address = peer.partition(":")
    host, _, port = address.rpartition(":")
    if not host or not port.isdigit():
        return (peer, 0)
    return (host.strip("[]"), int(port))


def _nothing() -> None:
    """Nothing to stop."""
