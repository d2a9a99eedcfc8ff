"""The engine's request bookkeeping: who waits, who is mid-prefill, what each one holds."""

from __future__ import annotations

import asyncio
import time
from dataclasses import replace

from scheduler.admission import AdmissionControl
from scheduler.kv_blocks import BlockAllocator
from scheduler.planner import BatchPlan, PlannerSeq
from scheduler.request import PoolingOutput, PoolingRequest, RequestStatus
from scheduler.runner import ChunkWork


class RequestQueues:
    """Waiting and running requests with their KV blocks and admission share (loop task only)."""

    def __init__(self, blocks: BlockAllocator, admission: AdmissionControl) -> None:
        self.blocks = blocks
        self.admission = admission
        # dicts keep arrival order and make removal O(1)
        self.waiting: dict[int, PoolingRequest] = {}
        self.running: dict[int, PoolingRequest] = {}  # partially prefilled: chunks still to plan
        self.by_id: dict[int, PoolingRequest] = {}
        self._by_future: dict[asyncio.Future[PoolingOutput], int] = {}
        # The planner's view of each request, rebuilt only when the request advances.
        self._views: dict[int, PlannerSeq] = {}

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
        )

    def planner_inputs(self) -> tuple[list[PlannerSeq], list[PlannerSeq]]:
        """(waiting, running) as the planner sees them."""
        views = self._views
        return [views[r] for r in self.waiting], [views[r] for r in self.running]

    def apply(self, plan: BatchPlan) -> list[ChunkWork]:
        """Advance request state as if the plan had run, so the next plan can be made at once."""
        now = time.monotonic()
        work = []
        for chunk in plan.chunks:
            request = self.by_id[chunk.request_id]
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
            work.append(
                ChunkWork(
                    request.request_id,
                    request.prompt_token_ids[span],
                    start,
                    chunk.is_last,
                    tuple(request.block_ids),
                    request.pooler,
                    None if types is None else types[span],
                )
            )
        return work

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
