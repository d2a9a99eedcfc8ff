"""The engine's request bookkeeping: who waits, who is mid-prefill, what each one holds."""

from __future__ import annotations

import asyncio
import time
from dataclasses import replace
from typing import TYPE_CHECKING

import numpy as np

from poolserve.engine.runner import ChunkWork
from poolserve.engine.sched.planner import (
    QUEUE_ORDER,
    BatchPlan,
    ImageRun,
    PlannerSeq,
    ScheduledChunk,
    max_hit_blocks,
)
from poolserve.engine.sched.prefix_cache import CacheUse, PrefixCache, extend_block_hashes
from poolserve.engine.sched.request import PoolingRequest, RequestStatus
from poolserve.types.admission import AdmissionControl
from poolserve.types.limits import SchedulerConfig
from poolserve.types.outputs import PoolingOutput

if TYPE_CHECKING:
    from poolserve.engine.vision_rows import RequestImages


class RequestQueues:
    """Waiting and running requests with their KV blocks and admission share (loop task only)."""

    def __init__(
        self, blocks: PrefixCache, admission: AdmissionControl, config: SchedulerConfig
    ) -> None:
        self.blocks = blocks
        self.admission = admission
        self._max_num_tokens = config.max_num_batched_tokens
        self._max_num_seqs = config.max_num_seqs
        # dicts keep arrival order and make removal O(1)
        self.waiting: dict[int, PoolingRequest] = {}
        self.running: dict[int, PoolingRequest] = {}  # partially prefilled: chunks still to plan
        self.by_id: dict[int, PoolingRequest] = {}
        self._by_future: dict[asyncio.Future[PoolingOutput], int] = {}
        # The planner's view of each request, rebuilt only when the request advances.
        self._views: dict[int, PlannerSeq] = {}
        # Cached blocks each sharing waiting request found for the plan being made; `apply` takes
        # them (nothing changes the cache between the two calls, both run on the loop task).
        self._hits: dict[int, list[int]] = {}

    def __len__(self) -> int:
        return len(self.by_id)

    @property
    def has_work(self) -> bool:
        """True when some request still has chunks to plan."""
        return bool(self.waiting or self.running)

    def add(self, request: PoolingRequest) -> None:
        """Queue an admitted request."""
        rid = request.request_id
        self.waiting[rid] = self.by_id[rid] = request
        self._by_future[request.future] = rid
        self._views[rid] = PlannerSeq(
            request_id=rid,
            num_prompt_tokens=request.num_prompt_tokens,
            num_computed_tokens=0,
            num_blocks_held=0,
            priority=request.priority,
            arrival_index=request.arrival_index,
            caches_prefix=request.cache_use is CacheUse.SHARE,
            images=image_runs(request.images),
        )

    def planner_inputs(self) -> tuple[list[PlannerSeq], list[PlannerSeq]]:
        """(waiting, running) as the planner sees them, with the cache hits of sharing requests."""
        views = self._views
        self._hits.clear()
        running = [views[r] for r in self.running]
        if not self.blocks.num_cached:
            return [views[r] for r in self.waiting], running
        return self._waiting_views(), running

    def _waiting_views(self) -> list[PlannerSeq]:
        """Waiting views; those the next step could admit start after the blocks they find cached.

        Only requests in queue order until their uncached tokens or their count fill a step look
        up, so a long queue costs no hashing per step; the others keep views from token 0, which
        is what the planner gives them if it admits them after all.
        """
        views = {rid: self._views[rid] for rid in self.waiting}
        num_tokens, num_seqs = self._max_num_tokens, self._max_num_seqs
        for request in sorted(self.waiting.values(), key=QUEUE_ORDER):
            if num_tokens <= 0 or num_seqs <= 0:
                break
            view = views[request.request_id]
            if request.cache_use is CacheUse.SHARE:
                view = views[request.request_id] = self._hit_view(request, view)
            num_tokens -= view.num_prompt_tokens - view.num_computed_tokens
            num_seqs -= 1
        return list(views.values())

    def _hit_view(self, request: PoolingRequest, view: PlannerSeq) -> PlannerSeq:
        """The view of a sharing request that starts after the cached blocks it finds."""
        block_size = self.blocks.block_size
        hits = []
        for index in range(max_hit_blocks(request.num_prompt_tokens, block_size)):
            block_id = self.blocks.find(self._block_hash(request, index))
            if block_id is None:
                break
            hits.append(block_id)
        if not hits:
            return view
        self._hits[request.request_id] = hits
        return replace(
            view,
            num_computed_tokens=len(hits) * block_size,
            num_blocks_held=len(hits),
            num_reused_free_blocks=self.blocks.num_free_among(hits),
        )

    def _block_hash(self, request: PoolingRequest, index: int) -> bytes:
        """The chained hash of the request's full block `index`, hashing up to it on first need."""
        hashes = request.block_hashes
        if index >= len(hashes):
            images = request.images
            salt = None if images is None else (images.first_image, images.digest)
            extend_block_hashes(
                hashes, request.prompt_token_ids, self.blocks.block_size, index + 1, salt
            )
        return hashes[index]

    def apply(self, plan: BatchPlan) -> list[ChunkWork]:
        """Advance request state as if the plan had run, so the next plan can be made at once."""
        now = time.monotonic()
        # Hits first: a later chunk's allocation must not evict a block another chunk found.
        for chunk in plan.chunks:
            request = self.by_id[chunk.request_id]
            if request.status is RequestStatus.WAITING and request.cache_use is CacheUse.SHARE:
                self._take_hits(request, chunk)
        self._hits.clear()
        return [self._advance(self.by_id[chunk.request_id], chunk, now) for chunk in plan.chunks]

    def _advance(self, request: PoolingRequest, chunk: ScheduledChunk, now: float) -> ChunkWork:
        """Allocate the chunk's blocks, move the request along, and describe the chunk's work."""
        if chunk.num_new_blocks:
            request.block_ids.extend(self.blocks.allocate(chunk.num_new_blocks))
        if request.status is RequestStatus.WAITING:
            del self.waiting[request.request_id]
            request.status = RequestStatus.RUNNING
            request.first_scheduled_time = now
            if not chunk.is_last:
                self.running[request.request_id] = request
        elif chunk.is_last:
            del self.running[request.request_id]
        start = request.num_computed_tokens
        request.num_computed_tokens += chunk.num_tokens
        request.num_inflight_steps += 1
        if not chunk.is_last:
            self._views[request.request_id] = replace(
                self._views[request.request_id],
                num_computed_tokens=request.num_computed_tokens,
                num_blocks_held=len(request.block_ids),
            )
        span = slice(start, start + chunk.num_tokens)
        types = request.token_type_ids
        return ChunkWork(
            request.request_id,
            request.prompt_token_ids[span],
            start,
            chunk.is_last,
            tuple(request.block_ids),
            request.pooler,
            chunk.num_kv_tokens,
            None if types is None else types[span],
            request.adapter,
            request.pixels,
            request.images,
        )

    def _take_hits(self, request: PoolingRequest, chunk: ScheduledChunk) -> None:
        """Start a sharing request after the cached blocks it found, holding them."""
        hits = self._hits.get(request.request_id, [])
        num_hit_tokens = len(hits) * self.blocks.block_size
        if chunk.start != num_hit_tokens:
            raise RuntimeError(
                f"request {request.request_id}: planned from {chunk.start}, "
                f"but {num_hit_tokens} tokens were found cached"
            )
        self.blocks.share(hits)
        request.block_ids = list(hits)
        request.num_offered_blocks = len(hits)
        request.num_computed_tokens = num_hit_tokens
        self.blocks.record_lookup(num_hit_tokens, request.num_prompt_tokens)

    def offer_written(self, request: PoolingRequest, chunk: ChunkWork) -> None:
        """Make the full blocks a delivered chunk completed findable by later prompts.

        Only here, after the step was delivered: a failed step's KV may be garbage, and a request
        that failed or was cancelled meanwhile offers nothing. A block is found only by requests
        planned after this call, so into a later step than the one that wrote it; steps run in
        order (one worker thread on CPU; on CUDA one compute stream, and delivery waited for the
        step's copy event), so the write has landed before any reader runs.
        """
        if request.cache_use is CacheUse.NONE:
            return
        block_size = self.blocks.block_size
        num_full = (chunk.context_len + chunk.num_kv_tokens) // block_size
        if num_full <= request.num_offered_blocks:
            return
        for index in range(request.num_offered_blocks, num_full):
            self.blocks.register(request.block_ids[index], self._block_hash(request, index))
        request.num_offered_blocks = num_full

    def request_of(self, future: asyncio.Future[PoolingOutput]) -> PoolingRequest | None:
        """The live request behind a future handed out at submission."""
        rid = self._by_future.get(future)
        return None if rid is None else self.by_id.get(rid)

    def cancel(self, request: PoolingRequest) -> None:
        """Remove a request wherever it is; free its holdings unless a step still runs it."""
        if request.is_done:
            return
        request.status = RequestStatus.CANCELLED
        self._abandon(request)
        if not request.future.done():
            request.future.cancel()
        self._release_if_idle(request)

    def fail(self, request: PoolingRequest, error: Exception) -> None:
        """Fail a request (a done one keeps its outcome); free it once no step holds it."""
        if not request.is_done:
            request.status = RequestStatus.FAILED
            self._abandon(request)
            if not request.future.done():
                request.future.set_exception(error)
        self._release_if_idle(request)

    def step_delivered(self, request_id: int) -> PoolingRequest | None:
        """A step holding the request was delivered; the request if it can still produce output.

        A failed or cancelled one is freed here once no step in flight holds it any more.
        """
        request = self.by_id.get(request_id)
        if request is None:
            return None
        request.num_inflight_steps -= 1
        if request.is_done:
            self._release_if_idle(request)
            return None
        return request

    def release(self, request: PoolingRequest) -> None:
        """Return a finished request's blocks, pooling state and admission share."""
        if request.block_ids:
            self.blocks.free(request.block_ids)
            request.block_ids = []
        request.pooler.close()
        if self.by_id.pop(request.request_id, None) is not None:
            self._by_future.pop(request.future, None)
            self._views.pop(request.request_id, None)
            self.admission.release(1, request.num_prompt_tokens)

    def _abandon(self, request: PoolingRequest) -> None:
        """Plan no more of the request's chunks and skip pooling those already planned."""
        self.waiting.pop(request.request_id, None)
        self.running.pop(request.request_id, None)
        request.pooler.abandon()

    def _release_if_idle(self, request: PoolingRequest) -> None:
        """Free a done request unless a step in flight still reads its blocks or pooler."""
        if request.num_inflight_steps == 0:
            self.release(request)

    def num_running(self) -> int:
        """Requests that have started and not finished."""
        return sum(1 for r in self.by_id.values() if r.status is RequestStatus.RUNNING)


def image_runs(images: RequestImages | None) -> tuple[ImageRun, ...]:
    """Where each image of a prompt sits ([start, end) of its placeholder tokens, found from the
    image rows before each position) and the patches its tower runs over."""
    if images is None:
        return ()
    row_starts = np.concatenate([[0], images.row_ends[:-1]])
    # an image's first token: the first position with its first row among the rows before it
    starts = np.searchsorted(images.before, row_starts + 1, side="left") - 1
    ends = np.searchsorted(images.before, images.row_ends, side="left")
    patches = [p.shape[0] for p in images.media.patches]
    return tuple(ImageRun(int(a), int(b), n) for a, b, n in zip(starts, ends, patches, strict=True))
