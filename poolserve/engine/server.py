"""`EngineCore`: one engine served to any number of front ends on a Unix socket.

The core's event loop only moves messages: a Submit becomes one `Engine.submit_many` (the
engine's own admission decides, counted across every front end; a refusal is not a reply of
its own, each prompt of the Submit fails with the engine's error), each output is queued for
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

from poolserve.engine.card import card_of
from poolserve.engine.loop import Engine
from poolserve.types import protocol
from poolserve.types.lora import LoraModule
from poolserve.types.outputs import PoolingOutput
from poolserve.types.protocol import (
    Adapt,
    Adapted,
    Adapters,
    Beat,
    Cancel,
    Card,
    Hello,
    Load,
    OutputHead,
    Query,
    Results,
    Snapshot,
    Submit,
    WireError,
)
from poolserve.types.wire import MessageStream

logger = logging.getLogger(__name__)

# A front end that hears nothing for its --engine-core-timeout calls the core dead; beats keep
# an idle core audible well inside any sensible timeout.
BEAT_INTERVAL_S = 0.5

Key = tuple[MessageStream, int]  # (a front end's connection, its request id)
Done = PoolingOutput | BaseException | None  # None: the engine stopped before it finished


class EngineCore:
    """Serves one started engine to every front end that connects, until stopped."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self.card = card_of(engine).dumps()
        self.front_ends: set[MessageStream] = set()
        self.pending: dict[Key, asyncio.Future[PoolingOutput]] = {}
        self._outbox: defaultdict[MessageStream, list[tuple[int, Done]]] = defaultdict(list)
        self._flush_scheduled = False
        self._told: dict[MessageStream, Load] = {}  # the load each front end last heard
        self._handlers = {
            Hello: self._hello,
            Submit: self._submit,
            Cancel: self._cancel,
            Query: self._query,
            Adapt: self._adapt,
        }
        self._adapting: set[asyncio.Task[None]] = set()  # loads and unloads under way

    def connection(self) -> MessageStream:
        """The protocol of one front end's connection (the Unix server's factory)."""
        stream = MessageStream(self._handle, self._lost)
        self.front_ends.add(stream)
        return stream

    async def beat(self) -> None:
        """Heartbeats with the admission counters, until cancelled."""
        while True:
            await asyncio.sleep(BEAT_INTERVAL_S)
            beat = Beat(self.load())
            for who in self.front_ends:
                self._send(who, beat)

    def _handle(self, who: MessageStream, header: memoryview, frames: list[memoryview]) -> None:
        try:
            message = protocol.decode_to_core(header)
        except Exception:  # only the server's own front ends connect: log it and go on
            logger.exception("engine core: undecodable message")
            return
        self._handlers[type(message)](who, message, frames)  # type: ignore[operator]

    def _lost(self, who: MessageStream, exc: Exception | None) -> None:
        """A front end went away: the work it asked for is freed, nobody waits for it."""
        self.front_ends.discard(who)
        self._told.pop(who, None)
        mine = [key for key in self.pending if key[0] is who]
        for key in mine:
            future = self.pending.pop(key)
            if not future.done():
                self.engine.cancel_future(future)
        if mine:
            logger.warning("engine core: a front end left; %d request(s) cancelled", len(mine))

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
    def _hello(self, who: MessageStream, message: Hello, frames: Sequence[memoryview]) -> None:
        self._send(who, Card(self.card, self.load()))

    def _submit(self, who: MessageStream, message: Submit, frames: Sequence[memoryview]) -> None:
        try:
            prompts, types = protocol.split_prompts(message, frames)
            futures = self.engine.submit_many(
                cast("list[Sequence[int]]", prompts),
                message.params,
                message.priority,
                cast("list[Sequence[int] | None] | None", types),
                checked=True,  # the front end checked them against the model card
                pixels=protocol.split_pixels(message, frames, self.engine.loaded.images),
                media=protocol.split_media(message, frames, self.engine.loaded.inline_images),
            )
        except Exception as exc:  # refused as a whole: each prompt fails with the engine's error
            for request_id in message.ids:
                self._queue(who, request_id, exc)
            return
        for request_id, future in zip(message.ids, futures, strict=True):
            self.pending[(who, request_id)] = future
            future.add_done_callback(partial(self._done, who, request_id))

    def _cancel(self, who: MessageStream, message: Cancel, frames: Sequence[memoryview]) -> None:
        for request_id in message.ids:
            future = self.pending.pop((who, request_id), None)
            if future is not None and not future.done():
                self.engine.cancel_future(future)

    def _query(self, who: MessageStream, message: Query, frames: Sequence[memoryview]) -> None:
        payload = pickle.dumps(self.engine.snapshot())
        self._send(who, Snapshot(message.token, payload, self.load()))

    def _adapt(self, who: MessageStream, message: Adapt, frames: Sequence[memoryview]) -> None:
        task = asyncio.get_running_loop().create_task(self._change_adapters(who, message))
        self._adapting.add(task)
        task.add_done_callback(self._adapting.discard)

    async def _change_adapters(self, who: MessageStream, message: Adapt) -> None:
        """Load or unload an adapter; the asker hears how it went, every front end the new set."""
        error = None
        try:
            if message.path is None:
                await self.engine.unload_adapter(message.name)  # once its requests are done
            else:
                module = LoraModule(message.name, message.path, message.base_model_name)
                await self.engine.load_adapter(module)
        except Exception as exc:  # the asker answers it: 400, 404
            error = protocol.wire_error(exc)
        self._send(who, Adapted(message.token, error, self.load()))
        if error is None:
            self._broadcast_adapters()

    def _broadcast_adapters(self) -> None:
        adapters = self.engine.adapters
        modules = [] if adapters is None else list(adapters.modules)
        listed = [(m.name, m.path, m.base_model_name) for m in modules]
        for front_end in list(self.front_ends):
            self._send(front_end, Adapters(listed, self.load()))

    # ---- outputs ------------------------------------------------------------------------------
    def _done(
        self, who: MessageStream, request_id: int, future: asyncio.Future[PoolingOutput]
    ) -> None:
        """Queue a finished request for its front end; one flush per loop turn sends them."""
        if self.pending.pop((who, request_id), None) is None:
            return  # cancelled by its front end: nobody waits for it
        result: PoolingOutput | BaseException | None = None  # None: the engine stopped first
        if not future.cancelled():
            result = future.exception() or future.result()
        self._queue(who, request_id, result)

    def _queue(self, who: MessageStream, request_id: int, result: Done) -> None:
        """Queue one request's end for its front end; one flush per loop turn sends them."""
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
        self, who: MessageStream, message: protocol.ToFrontEnd, buffers: Sequence[object] = ()
    ) -> None:
        if who not in self.front_ends:
            return  # gone: what it asked for was cancelled
        self._told[who] = message.load
        # never waits: the transport buffers, and admission bounds what can be owed
        who.send(protocol.encode(message), buffers)


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
