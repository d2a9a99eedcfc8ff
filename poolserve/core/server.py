"""`EngineCore`: one engine served to any number of front ends over a ZMQ ROUTER socket.

The core's event loop only moves messages: a Submit becomes one `Engine.submit_many` (the
engine's own admission decides, counted across every front end), each output is queued for
its front end as its future resolves, and everything one step delivered to a front end leaves
as one Results message. The engine's mechanisms (async scheduling, clone-before-copy, task
gating, priority, prefix caching) are untouched: the core is a transport around `Engine`.
"""

from __future__ import annotations

import asyncio
import logging
import pickle
from collections import defaultdict
from collections.abc import Sequence
from functools import partial
from typing import cast

import numpy as np
import zmq
import zmq.asyncio

from poolserve.core import protocol
from poolserve.core.card import ModelCard
from poolserve.core.protocol import (
    Accepted,
    Beat,
    Cancel,
    Card,
    Hello,
    Load,
    OutputHead,
    Query,
    Refused,
    Results,
    Snapshot,
    Submit,
    WireError,
)
from poolserve.scheduler.engine import Engine
from poolserve.scheduler.request import PoolingOutput

logger = logging.getLogger(__name__)

# A front end that hears nothing for its --engine-core-timeout calls the core dead; beats keep
# an idle core audible well inside any sensible timeout.
BEAT_INTERVAL_S = 0.5

Key = tuple[bytes, int]  # (front end identity, its request id)


class EngineCore:
    """Serves one started engine on a bound ROUTER socket until stopped."""

    def __init__(self, engine: Engine, socket: zmq.asyncio.Socket) -> None:
        self.engine = engine
        self.socket = socket
        self.card = ModelCard.of(engine).dumps()
        self.front_ends: set[bytes] = set()
        self.pending: dict[Key, asyncio.Future[PoolingOutput]] = {}
        self._outbox: defaultdict[bytes, list[tuple[int, PoolingOutput | BaseException | None]]] = (
            defaultdict(list)
        )
        self._flush_scheduled = False
        self._beat_task: asyncio.Future[None] | None = None
        self._told: dict[bytes, Load] = {}  # the load each front end last heard
        self._handlers = {
            Hello: self._hello,
            Submit: self._submit,
            Cancel: self._cancel,
            Query: self._query,
        }

    async def serve(self) -> None:
        """Answer front ends and send heartbeats until cancelled."""
        self._beat_task = asyncio.ensure_future(self._beat())
        try:
            while True:
                identity, header, *frames = await self.socket.recv_multipart(copy=False)
                self._handle(identity.bytes, header.buffer, [f.buffer for f in frames])
        finally:
            self._beat_task.cancel()

    def _handle(self, who: bytes, header: memoryview, frames: Sequence[memoryview]) -> None:
        try:
            message = protocol.decode_to_core(header)
        except Exception:  # only the server's own front ends connect: log it and go on
            logger.exception("engine core: undecodable message from %r", who)
            return
        self._handlers[type(message)](who, message, frames)  # type: ignore[operator]

    def load(self) -> Load:
        """The admission counters and health every reply carries."""
        admission = self.engine.admission
        return Load(
            admission.queued_requests,
            admission.queued_tokens,
            admission.throughput_tokens_per_s,
            self.engine.dead_reason,
            self.engine.draining,
            self.engine.is_alive,
        )

    # ---- handlers ----------------------------------------------------------------------------
    def _hello(self, who: bytes, message: Hello, frames: Sequence[memoryview]) -> None:
        self.front_ends.add(who)
        self._send(who, Card(self.card, self.load()))

    def _submit(self, who: bytes, message: Submit, frames: Sequence[memoryview]) -> None:
        try:
            prompts, types = protocol.split_prompts(message, frames)
            futures = self.engine.submit_many(
                cast("list[Sequence[int]]", prompts),
                message.params,
                message.priority,
                cast("list[Sequence[int] | None] | None", types),
            )
        except Exception as exc:  # the engine's refusal, for the front end to raise as its own
            self._send(who, Refused(message.batch, protocol.wire_error(exc), self.load()))
            return
        for request_id, future in zip(message.ids, futures, strict=True):
            self.pending[(who, request_id)] = future
            future.add_done_callback(partial(self._done, who, request_id))
        self._send(who, Accepted(message.batch, self.load()))

    def _cancel(self, who: bytes, message: Cancel, frames: Sequence[memoryview]) -> None:
        for request_id in message.ids:
            future = self.pending.pop((who, request_id), None)
            if future is not None and not future.done():
                self.engine.cancel_future(future)

    def _query(self, who: bytes, message: Query, frames: Sequence[memoryview]) -> None:
        payload = pickle.dumps(self.engine.snapshot())
        self._send(who, Snapshot(message.token, payload, self.load()))

    # ---- outputs ------------------------------------------------------------------------------
    def _done(self, who: bytes, request_id: int, future: asyncio.Future[PoolingOutput]) -> None:
        """Queue a finished request for its front end; one flush per loop turn sends them."""
        if self.pending.pop((who, request_id), None) is None:
            return  # cancelled by its front end: nobody waits for it
        result: PoolingOutput | BaseException | None = None  # None: the engine stopped first
        if not future.cancelled():
            result = future.exception() or future.result()
        self._outbox[who].append((request_id, result))
        if not self._flush_scheduled:
            self._flush_scheduled = True
            asyncio.get_running_loop().call_soon(self._flush)

    def _flush(self) -> None:
        self._flush_scheduled = False
        load = self.load()
        for who, done in self._outbox.items():
            heads: list[OutputHead] = []
            failures: list[tuple[int, WireError]] = []
            cancelled: list[int] = []
            buffers: list[memoryview] = []
            for request_id, result in done:
                if result is None:
                    cancelled.append(request_id)
                elif isinstance(result, BaseException):
                    failures.append((request_id, protocol.wire_error(result)))
                else:
                    heads.append(_head(request_id, result))
                    buffers.append(np.ascontiguousarray(result.data).data)
            self._send(who, Results(heads, failures, cancelled, load), buffers)
        # the other front ends' early 429 reads these counters: they hear of the freed room now
        for who in self.front_ends.difference(self._outbox):
            if self._told.get(who) != load:
                self._send(who, Beat(load))
        self._outbox.clear()

    def _send(
        self, who: bytes, message: protocol.ToFrontEnd, buffers: Sequence[object] = ()
    ) -> None:
        self._told[who] = message.load
        # unbounded queues (HWM 0, admission bounds the work): a send never waits, never drops
        frames = [who, protocol.encode(message), *buffers]
        sent = cast("asyncio.Future[object]", self.socket.send_multipart(frames, copy=False))
        sent.add_done_callback(_log_failure)

    async def _beat(self) -> None:
        while True:
            await asyncio.sleep(BEAT_INTERVAL_S)
            beat = Beat(self.load())
            for who in self.front_ends:
                self._send(who, beat)


def _log_failure(sent: asyncio.Future[object]) -> None:
    if not sent.cancelled() and sent.exception() is not None:
        logger.error("engine core: a message to a front end failed", exc_info=sent.exception())


def _head(request_id: int, output: PoolingOutput) -> OutputHead:
    timeline = None if output.timeline is None else pickle.dumps(output.timeline)
    return OutputHead(
        request_id,
        output.num_prompt_tokens,
        output.queue_time_s,
        output.inference_time_s,
        output.data.dtype.str,
        list(output.data.shape),
        timeline,
    )
