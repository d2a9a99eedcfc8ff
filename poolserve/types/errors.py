"""Typed domain errors every layer raises; `http/errors.py` maps them to status codes and bodies.

Models, pooling and the engine raise their own families below; `APIError` is the front end's,
already carrying its HTTP shape (status, type, code).
"""

from __future__ import annotations

import enum
import sys
from collections.abc import Iterable

from poolserve.types.model import DEFAULT_MODEL_ID

# Bounds on client-sent text an error may echo (a field name can be 100 KB long).
MAX_ECHO_CHARS = 128


def clip(text: str, limit: int = MAX_ECHO_CHARS) -> str:
    """At most limit characters of client-sent text, marked when cut; a lone surrogate (valid
    JSON, no UTF-8) is echoed escaped, so the error body that carries it can be encoded."""
    cut = text if len(text) <= limit else text[:limit] + "..."
    return cut.encode("utf-8", "backslashreplace").decode("utf-8")


def command_error(command: str, message: str, code: int = 1) -> int:
    """A command's runtime error as argparse says a usage error (`poolserve CMD: error: ...` on
    stderr, one line); the exit code to return (1, or 130 when interrupted; usage errors exit 2
    in argparse). Every command and process of the CLI says its errors this way."""
    line = " ".join(part.strip() for part in message.strip().splitlines() if part.strip())
    sys.stderr.write(f"poolserve {command}: error: {line}\n")
    sys.stderr.flush()
    return code


# --- models: loading and input validation ---


class ModelError(Exception):
    """Base class of every error raised by the models package."""


class ModelLoadError(ModelError):
    """A model directory, Hub id or checkpoint file could not be read."""


class LoraAdapterError(ModelLoadError):
    """A LoRA adapter that cannot run on the model exactly: the reason, never a fallback."""

    def __init__(self, name: str, reason: str) -> None:
        self.name = name
        self.reason = reason
        super().__init__(f"LoRA adapter {name!r}: {reason}" if name else f"LoRA adapters: {reason}")


class LoraAdapterExistsError(LoraAdapterError):
    """A load names an adapter already served (vLLM's words)."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.reason = "it has already been loaded"
        ModelLoadError.__init__(self, f"The lora adapter {name!r} has already been loaded.")


class LoraAdapterNotFoundError(ModelLoadError):
    """An unload names an adapter not served (vLLM's words)."""

    def __init__(self, name: str) -> None:
        self.name = name
        super().__init__(f"The lora adapter {name!r} cannot be found.")


class UnsafeCheckpointError(ModelError):
    """The checkpoint needs pickle weights or remote code, which are refused."""


class UnsupportedArchitectureError(ModelError):
    """The checkpoint's architecture has no native implementation here."""

    def __init__(self, architecture: str, supported: Iterable[str]) -> None:
        self.architecture = architecture
        self.supported = tuple(sorted(supported))
        super().__init__(
            f"unsupported architecture {architecture!r}; supported: {', '.join(self.supported)}"
        )


class InvalidTokenIdError(ModelError):
    """A token id is negative or not below the vocabulary size."""

    def __init__(self, token_id: int, vocab_size: int) -> None:
        self.token_id = token_id
        self.vocab_size = vocab_size
        super().__init__(f"token id {token_id} is out of range [0, {vocab_size})")


class InvalidTokenTypeError(ModelError):
    """Token type ids that do not fit their prompt or the model's token type table."""


class UnsupportedDtypeError(ModelError):
    """The requested dtype cannot run on the device."""

    def __init__(self, dtype: str, device: str, reason: str) -> None:
        self.dtype = dtype
        self.device = device
        super().__init__(f"dtype {dtype} cannot run on {device}: {reason}")


class UnsupportedQuantizationError(ModelError):
    """The requested quantization cannot run on the device, in the dtype or in this install."""

    def __init__(self, quantization: str, device: str, reason: str) -> None:
        self.quantization = quantization
        self.device = device
        super().__init__(f"quantization {quantization} cannot run on {device}: {reason}")


class SlowerPrecisionError(ModelError):
    """A precision below its floor on this CPU (a half dtype slower than float32, int8 under
    1.5x float32), or one that cannot run at all (one line)."""


# --- pooling: a request's parameters against its model ---


class PoolingError(Exception):
    """Base of every error raised by the pooling package."""


class UnsupportedTaskError(PoolingError):
    """A request asked for a task the model cannot serve."""

    def __init__(self, task: str, supported: Iterable[str]) -> None:
        self.task = task
        self.supported = tuple(sorted(supported))
        names = ", ".join(self.supported) or "none"
        # vLLM's words first ("Unsupported task: 'embed'"), which its clients and tests match
        super().__init__(f"Unsupported task: {task!r}; this model's supported tasks: {names}")


class InvalidPoolingParamsError(PoolingError):
    """A pooling parameter is out of range or makes no sense for the task or model."""

    def __init__(self, param_name: str, message: str) -> None:
        self.param_name = param_name
        self.message = message
        super().__init__(f"{param_name}: {message}")


class PoolingConfigError(PoolingError):
    """The model description handed to pooling is inconsistent (a loader bug, not a request bug)."""


class PoolingStateError(PoolingError):
    """A request pooler was driven out of order: chunk after the last one or close, or empty."""


# --- engine: admission, KV blocks, planning, steps ---


class OverloadReason(enum.Enum):
    """Why admission refused work that may succeed later."""

    QUEUE_FULL = "queue_full"
    TOKENS_FULL = "tokens_full"
    TOKENIZING_FULL = "tokenizing_full"  # the characters being tokenized at once
    ADAPTER_SLOTS = "adapter_slots"  # every --max-loras slot runs other adapters' requests


class SchedulerError(Exception):
    """Base of every error raised by the scheduler."""


class OverloadedError(SchedulerError):
    """Admission refused the work for now; the client should retry after `retry_after_s`."""

    def __init__(self, reason: OverloadReason, retry_after_s: float, detail: str) -> None:
        super().__init__(f"server overloaded ({reason.value}): {detail}")
        self.reason = reason
        self.retry_after_s = retry_after_s


class RequestTooLargeError(SchedulerError):
    """The work exceeds an admission limit even with an empty queue: retrying cannot help."""

    def __init__(self, what: str, requested: int, limit: int) -> None:
        super().__init__(f"{what}: {requested} requested, the limit is {limit}")
        self.requested = requested
        self.limit = limit


class PromptTooLongError(SchedulerError):
    """A prompt longer than the model or the scheduler can ever run."""

    def __init__(
        self, num_prompt_tokens: int, max_prompt_tokens: int, request_id: int | None = None
    ) -> None:
        who = "the prompt" if request_id is None else f"request {request_id}"
        super().__init__(
            f"{who} has {num_prompt_tokens} tokens; at most {max_prompt_tokens} can be run"
        )
        self.num_prompt_tokens = num_prompt_tokens
        self.max_prompt_tokens = max_prompt_tokens
        self.request_id = request_id


class NoFreeBlocksError(SchedulerError):
    """The KV block allocator has fewer free blocks than asked for."""

    def __init__(self, num_requested: int, num_free: int) -> None:
        super().__init__(f"asked for {num_requested} KV blocks, only {num_free} free")
        self.num_requested = num_requested
        self.num_free = num_free


class BlockFreeError(SchedulerError):
    """A free() named a block that is not allocated (double free, duplicate or foreign id)."""


class DrainingError(SchedulerError):
    """The engine is draining for shutdown and takes no new work (not an overload)."""

    def __init__(self) -> None:
        super().__init__("the server is draining and accepts no new requests")


class EngineDeadError(SchedulerError):
    """The engine stopped after a fatal error; every request fails until restart."""

    def __init__(self, reason: str) -> None:
        super().__init__(f"the engine has stopped: {reason}")
        self.reason = reason


class StepFailedError(SchedulerError):
    """One step failed; the requests in it fail, the engine keeps running."""


class EmptyPromptError(SchedulerError):
    """A prompt with no tokens: there is nothing to pool."""

    def __init__(self) -> None:
        super().__init__("the prompt has no tokens")


class ModelStartError(ValueError):
    """One model of the core could not be loaded or built; the message names it."""

    def __init__(self, model: str | None, cause: Exception) -> None:
        name = model or DEFAULT_MODEL_ID
        said = str(cause)
        # a cause that already names the model (the model's path or Hub id) is said once
        super().__init__(said if said.startswith(f"model {name!r}") else f"model {name!r}: {said}")
        self.model = model


# --- front end: request errors that carry their HTTP shape ---


class APIError(Exception):
    """An error raised by the service layer itself, already carrying its HTTP shape."""

    status = 400
    type = "invalid_request_error"
    code = "invalid_request"

    def __init__(self, message: str, param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.param = param
        self.code = code or type(self).code


class InvalidRequestError(APIError):
    """Bad input (400)."""


class RouteNotServedError(APIError):
    """A route the model serves no task of (404: vLLM does not register the route for it)."""

    status, type, code = 404, "not_found_error", "unsupported_task"


class AuthenticationError(APIError):
    """Missing or wrong API key (401)."""

    status, type, code = 401, "authentication_error", "invalid_api_key"


class PermissionDeniedError(APIError):
    """The API key may not use this model or route (403)."""

    status, type, code = 403, "permission_error", "permission_denied"


class KeyRateLimitedError(APIError):
    """The API key's own limit is spent for now (429; Retry-After: `retry_after_s`, rounded up)."""

    status, type, code = 429, "rate_limit_error", "rate_limit_exceeded"

    def __init__(self, message: str, retry_after_s: float) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s


class ModelNotFoundError(APIError):
    """Unknown `model` name (404)."""

    status, type, code = 404, "not_found_error", "model_not_found"


class NotFoundError(APIError):
    """A file or batch the caller has none of (404; another API key's is answered the same)."""

    status, type, code = 404, "not_found_error", "not_found"


class PayloadTooLargeError(APIError):
    """Request body above --payload-limit (413)."""

    status, type, code = 413, "invalid_request_error", "payload_too_large"


class InvalidImageError(InvalidRequestError):
    """An image input that cannot be used: not a data URL, base64 or an allowed http(s) URL,
    refused by the media policy, not fetched, or not a decodable PNG, JPEG, WebP or GIF (400)."""

    code = "invalid_image"


class ImageTooLargeError(PayloadTooLargeError):
    """An image above --max-image-bytes (encoded) or --max-image-pixels (decoded) (413)."""

    code = "image_too_large"


class ImageFetchTimeoutError(APIError):
    """An image URL not fetched within --media-fetch-timeout (408: a client error, as the URL
    is the client's, and one a client may retry)."""

    status, type, code = 408, "invalid_request_error", "image_fetch_timeout"


class NotReadyError(APIError):
    """The server is still warming up (503)."""

    status, type, code = 503, "service_unavailable", "not_ready"


class ShutdownError(APIError):
    """The drain deadline passed before this request finished (503)."""

    status, type, code = 503, "service_unavailable", "shutdown"


class ClientDisconnectedError(APIError):
    """The client went away before its answer (499, as nginx counts it; nobody reads the body)."""

    status, type, code = 499, "client_closed_request", "client_closed_request"
