"""Typed errors of admission, KV block allocation and planning."""

from __future__ import annotations

import enum


class OverloadReason(enum.Enum):
    """Why admission refused work that may succeed later."""

    QUEUE_FULL = "queue_full"
    TOKENS_FULL = "tokens_full"
    TOKENIZING_FULL = "tokenizing_full"  # the characters being tokenized at once


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
