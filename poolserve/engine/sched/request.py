"""A pooling request's life inside the engine, and the output handed back to the caller."""

from __future__ import annotations

import asyncio
import enum
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np

from poolserve.engine.sched.prefix_cache import CacheUse
from poolserve.pooling.tasks import RequestPooler
from poolserve.types.outputs import PoolingOutput, RequestTimeline, StepTiming

if TYPE_CHECKING:
    from poolserve.engine.vision_rows import RequestImages


class RequestStatus(enum.Enum):
    """Where a request is in its life."""

    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"
    CANCELLED = "cancelled"
    FAILED = "failed"


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
    adapter: int | None = None  # index of the LoRA adapter its tokens run through; None: none
    status: RequestStatus = RequestStatus.WAITING
    num_computed_tokens: int = 0  # tokens already handed to a step (scheduled), not necessarily run
    block_ids: list[int] = field(default_factory=list)
    num_inflight_steps: int = 0  # steps holding this request that have not been delivered yet
    first_scheduled_time: float | None = None
    cache_use: CacheUse = CacheUse.NONE
    block_hashes: list[bytes] = field(default_factory=list)  # of leading full blocks, as needed
    num_offered_blocks: int = 0  # leading blocks found in or offered to the prefix cache
    steps: list[StepTiming] | None = None  # the steps it ran in; None: timelines are off
    # an image's pixel values [channels, height, width]; its prompt ids are placeholders
    pixels: np.ndarray | None = None
    # a vision-language prompt's images, its M-RoPE positions, its tower rows once computed
    images: RequestImages | None = None

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
