"""A pooling request's life inside the engine, and the output handed back to the caller."""

from __future__ import annotations

import asyncio
import enum
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

from poolserve.models.errors import InvalidTokenTypeError
from poolserve.models.packed import validate_token_ids, validate_token_type_ids
from poolserve.pooling.tasks import RequestPooler
from poolserve.scheduler.errors import EmptyPromptError, PromptTooLongError
from poolserve.scheduler.prefix_cache import CacheUse


class RequestStatus(enum.Enum):
    """Where a request is in its life."""

    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"
    CANCELLED = "cancelled"
    FAILED = "failed"


@dataclass(frozen=True)
class StepTiming:
    """One engine step that ran a chunk of a request."""

    step_index: int
    started_at: float  # time.monotonic() when the step's forward began
    duration_s: float  # forward + pooling
    num_step_tokens: int  # every request's tokens in the step
    num_step_seqs: int  # chunks in the step
    num_tokens: int  # this request's chunk


@dataclass(frozen=True)
class RequestTimeline:
    """Where a request's time went inside the engine (time.monotonic() instants)."""

    arrival_time: float
    first_scheduled_time: float
    finished_time: float
    steps: tuple[StepTiming, ...]


@dataclass(frozen=True)
class PoolingOutput:
    """One finished request: its pooled output on the host and its timings."""

    request_id: int
    data: np.ndarray  # float32, shape per task (see pooling/params.py)
    num_prompt_tokens: int
    queue_time_s: float
    inference_time_s: float
    timeline: RequestTimeline | None = None  # only when the engine records timelines


@dataclass(eq=False)
class PoolingRequest:
    """Engine-owned state of one prompt; only the engine's loop task mutates it."""

    request_id: int
    prompt_token_ids: np.ndarray  # [num_prompt_tokens] int64; chunks are views of it
    pooler: RequestPooler
    future: asyncio.Future[PoolingOutput]
    arrival_time: float
    arrival_index: int
    priority: int = 0
    # [num_prompt_tokens] int64 segment ids (BERT pairs); None: every token is type 0
    token_type_ids: np.ndarray | None = None
    status: RequestStatus = RequestStatus.WAITING
    num_computed_tokens: int = 0  # tokens already handed to a step (scheduled), not necessarily run
    block_ids: list[int] = field(default_factory=list)
    num_inflight_steps: int = 0  # steps holding this request that have not been delivered yet
    first_scheduled_time: float | None = None
    cache_use: CacheUse = CacheUse.NONE
    block_hashes: list[bytes] = field(default_factory=list)  # of leading full blocks, as needed
    num_offered_blocks: int = 0  # leading blocks found in or offered to the prefix cache
    steps: list[StepTiming] | None = None  # the steps it ran in; None: timelines are off

    @property
    def num_prompt_tokens(self) -> int:
        """Length of the prompt in tokens."""
        return len(self.prompt_token_ids)

    @property
    def num_remaining_tokens(self) -> int:
        """Prompt tokens not yet scheduled."""
        return self.num_prompt_tokens - self.num_computed_tokens

    @property
    def is_done(self) -> bool:
        """True once the request can no longer produce an output."""
        return self.status in (
            RequestStatus.FINISHED,
            RequestStatus.CANCELLED,
            RequestStatus.FAILED,
        )

    def output(self, pooled: np.ndarray, now: float) -> PoolingOutput:
        """The caller's view of this request finished at `now` with its pooled host array."""
        started = self.first_scheduled_time or now
        timeline = None
        if self.steps is not None:
            timeline = RequestTimeline(self.arrival_time, started, now, tuple(self.steps))
        return PoolingOutput(
            request_id=self.request_id,
            data=np.asarray(pooled, dtype=np.float32),
            num_prompt_tokens=self.num_prompt_tokens,
            queue_time_s=started - self.arrival_time,
            inference_time_s=now - started,
            timeline=timeline,
        )


def checked_prompt(prompt: Sequence[int], max_model_len: int, vocab_size: int) -> np.ndarray:
    """The prompt as the int64 array a request keeps, after length and id checks."""
    if len(prompt) == 0:
        raise EmptyPromptError()
    if len(prompt) > max_model_len:
        raise PromptTooLongError(len(prompt), max_model_len)
    if isinstance(prompt, np.ndarray):
        ids = prompt.astype(np.int64, copy=False)  # [num_prompt_tokens]
        validate_token_ids(torch.from_numpy(ids), vocab_size)
        return ids
    # Python's min and max on the tokenizer's list: exact for ids of any size (one beyond int64
    # is refused before the conversion) and a fifth of the cost of checking the array with torch
    validate_token_ids(prompt, vocab_size)
    return np.asarray(prompt, dtype=np.int64)


def checked_token_types(
    token_type_ids: Sequence[Sequence[int] | None] | None,
    token_ids: Sequence[np.ndarray],
    num_token_types: int,
) -> list[np.ndarray | None]:
    """Each prompt's type ids as the int64 array its request keeps, or None for all type 0."""
    if token_type_ids is None:
        return [None] * len(token_ids)
    if len(token_type_ids) != len(token_ids):
        raise ValueError(f"{len(token_type_ids)} token type lists for {len(token_ids)} prompts")
    return [
        None if types is None else _checked_types(types, len(ids), num_token_types)
        for ids, types in zip(token_ids, token_type_ids, strict=True)
    ]


def _checked_types(
    token_type_ids: Sequence[int], num_tokens: int, num_token_types: int
) -> np.ndarray | None:
    """One prompt's checked type ids; None when the forward would not tell them from none."""
    try:
        types = np.asarray(token_type_ids, dtype=np.int64)  # [num_tokens]
    except (OverflowError, TypeError, ValueError) as exc:
        raise InvalidTokenTypeError(f"token type ids must be integers: {exc}") from exc
    validate_token_type_ids(torch.from_numpy(types), num_tokens, num_token_types)
    # All type 0 is what no types mean, so the step skips its type buffer: a tokenizer's ids for
    # a single text cost nothing. A model without a type table ignores them, as transformers does.
    if num_token_types == 0 or not types.any():
        return None
    return types
