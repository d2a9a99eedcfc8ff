"""`EngineClient`: a front end's engine, the surface the request pipeline calls, on a socket.

Checks that need only the model card (parameters, prompt lengths and ids, token types) and
the early 429 (against the core's admission counters, mirrored from every message it sends)
run here without a round trip; `submit_many` sends the prompts and returns their futures at
once: the core's admission, which counts every front end's work, decides, and what it refuses
fails those futures with its error. The core's silence for `timeout_s`, or its connection
closing, marks it dead: waiting requests fail with `EngineDeadError` (503) at once.
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import logging
import pickle
import time
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from poolserve.types import protocol
from poolserve.types.admission import AdmissionControl
from poolserve.types.card import ModelCard
from poolserve.types.errors import DrainingError, EngineDeadError, OverloadedError
from poolserve.types.images import image_prompt
from poolserve.types.lora import LoraModule
from poolserve.types.model_info import PoolingModelInfo
from poolserve.types.observer import EngineObserver, NullObserver
from poolserve.types.outputs import PoolingOutput
from poolserve.types.params import PoolingParams
from poolserve.types.prompts import checked_prompt, checked_token_types
from poolserve.types.protocol import (
    Adapt,
    Adapted,
    Adapters,
    Beat,
    Cancel,
    Card,
    Hello,
    Load,
    Query,
    Results,
    Snapshot,
    Submit,
)
from poolserve.types.stats import EngineSnapshot
from poolserve.types.tasks import PoolingTask
from poolserve.types.validation import validate_params
from poolserve.types.vision import PromptImages
from poolserve.types.wire import MessageStream

logger = logging.getLogger(__name__)

# which waiting caller a reply answers: the card answers connect(), the others name theirs
REPLY_KEYS: dict[type, Callable[[Any], int]] = {
    Card: lambda message: -1,
    Snapshot: lambda message: message.token,
    Adapted: lambda message: message.token,
}
# How often a front end tries to reach an engine core that is not listening yet.
CONNECT_RETRY_S = 0.1
# A /metrics scrape waits this long for the core's counters.
QUERY_TIMEOUT_S = 5.0


class EngineClient:
    """The engine as one front end sees it; every method runs on the front end's event loop."""

    def __init__(
        self, path: str, *, timeout_s: float, observer: EngineObserver | None = None
    ) -> None:
        self.path = path  # the engine core's Unix socket
        self.timeout_s = timeout_s
        self.observer = observer or NullObserver()
        self.stream: MessageStream | None = None
        self.dead_reason: str | None = None
        self.draining = False
        self._loop_alive = True  # the core's engine loop, as its last message said
        self._lost = False  # the core went silent or its connection closed
        self._card: ModelCard | None = None
        self._admission: AdmissionControl | None = None
        self._ids = itertools.count()
        self._pending: dict[int, asyncio.Future[PoolingOutput]] = {}
        self._id_of: dict[asyncio.Future[PoolingOutput], int] = {}
        self._replies: dict[int, asyncio.Future[object]] = {}  # snapshots, the card
        self._tasks: list[asyncio.Task[None]] = []
        self._last_heard = time.monotonic()
        self.last_snapshot: EngineSnapshot | None = None
        self._handlers: dict[type, Callable[[Any, list[memoryview]], None]] = {
            Card: self._on_reply,
            Snapshot: self._on_reply,
            Adapted: self._on_reply,
            Adapters: self._on_adapters,
            Results: self._on_results,
            Beat: lambda message, frames: None,
        }

    # ---- lifecycle -------------------------------------------------------------------------
    async def connect(self) -> ModelCard:
        """Introduce this front end and wait for the model card (the core may still be loading:
        until it listens, the connection is retried; the supervisor stops a server whose core
        fails to start)."""
        loop = asyncio.get_running_loop()
        while True:
            try:
                _, self.stream = await loop.create_unix_connection(
                    lambda: MessageStream(self._on_message, self._on_lost), self.path
                )
                break
            except (FileNotFoundError, ConnectionRefusedError):
                await asyncio.sleep(CONNECT_RETRY_S)
        reply = self._expect(-1)
        self._send(Hello())
        card = await reply
        assert isinstance(card, Card)
        self._card = ModelCard.loads(card.payload)
        self._admission = AdmissionControl.from_config(self._card.scheduler)
        self._mirror(card.load)
        self._tasks.append(loop.create_task(self._watchdog(), name="poolserve-core-watchdog"))
        return self._card

    async def close(self) -> None:
        """Stop listening; requests still waiting end as cancelled (the server stopped first)."""
        self.dead_reason = self.dead_reason or "this front end is shutting down"
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        for future in self._pending.values():
            future.cancel()
        for reply in self._replies.values():
            reply.cancel()
        self._pending.clear()
        self._id_of.clear()
        self._replies.clear()
        if self.stream is not None:
            stream, self.stream = self.stream, None  # closing it ourselves is no loss
            stream.close()

    # ---- what the pipeline calls ----------------------------------------------------------
    @property
    def card(self) -> ModelCard:
        """The served model (after connect)."""
        assert self._card is not None, "connect() first"
        return self._card

    @property
    def pooling_info(self) -> PoolingModelInfo:
        """The pooling view of the model's heads (structure only)."""
        return self.card.pooling_info

    @property
    def supported_tasks(self) -> frozenset[PoolingTask]:
        """Tasks the model serves."""
        return self.card.supported_tasks

    @property
    def max_model_len(self) -> int:
        """The longest prompt the engine runs."""
        return self.card.max_model_len

    @property
    def admission(self) -> AdmissionControl:
        """This front end's copy of the core's admission counters, as of its last message."""
        assert self._admission is not None, "connect() first"
        return self._admission

    @property
    def is_alive(self) -> bool:
        """Whether the engine core is there and its engine loop runs."""
        return self._loop_alive and not self._lost

    @property
    def busy(self) -> bool:
        """Whether any request of this front end is still in the engine."""
        return bool(self._pending)

    def precheck(self, num_requests: int) -> None:
        """Refuse before any tokenization when the engine cannot take num_requests more."""
        if self.dead_reason is not None:
            raise EngineDeadError(self.dead_reason)
        if self.draining:
            raise DrainingError()
        assert self._admission is not None, "connect() first"
        try:
            self._admission.precheck(num_requests)
        except OverloadedError as exc:
            self.observer.on_reject(exc.reason.value)
            raise

    def _reserve(self, num_requests: int, num_tokens: int) -> None:
        """Count a submission in the mirrored counters (the core's next message replaces them)."""
        assert self._admission is not None, "connect() first"
        try:
            self._admission.reserve(num_requests, num_tokens)
        except OverloadedError as exc:
            self.observer.on_reject(exc.reason.value)
            raise

    def check_params(self, params: PoolingParams) -> None:
        """Refuse parameters this model cannot serve, before any work is done for them."""
        validate_params(self.card.pooling_info, params)

    async def submit_many(
        self,
        prompts: Sequence[Sequence[int]],
        params: PoolingParams,
        priority: int = 0,
        token_type_ids: Sequence[Sequence[int] | None] | None = None,
        pixels: Sequence[np.ndarray | None] | None = None,
        media: Sequence[PromptImages | None] | None = None,
    ) -> list[asyncio.Future[PoolingOutput]]:
        """Admit all prompts or none; each gets a future, at once. `pixels`: per prompt, an
        image's pixel values (its prompt is then the image's placeholder), or None for a text.
        `media`: per prompt of a vision-language model, the images its placeholder runs stand
        for (their patches and grids; the engine checks runs against grids), or None.

        The core does not acknowledge a submission (a reply per request would cost both sides a
        message and this caller a loop turn): what it refuses fails each future with the engine's
        error. This front end first reserves the prompts in its copy of the core's counters, so
        that its own burst between two messages from the core meets the 429 here, before any work.
        """
        self.precheck(len(prompts))
        card = self.card
        if pixels is None:  # texts: the per-request path as it always was
            ids = [checked_prompt(p, card.max_model_len, card.vocab_size) for p in prompts]
        else:
            ids = [
                checked_prompt(p, card.max_model_len, card.vocab_size)
                if image is None
                else image_prompt(image, card.images)
                for p, image in zip(prompts, pixels, strict=True)
            ]
        types = checked_token_types(token_type_ids, ids, card.num_token_types)
        self.check_params(params)
        if not ids:
            return []
        self._reserve(len(ids), sum(len(prompt) for prompt in ids))
        lengths, typed, frames = protocol.flat_prompts(ids, types)
        image_flags: list[bool] = []
        grids: list[tuple[int, int]] = []
        if pixels is not None:
            image_flags, grids, pixel_frames = protocol.pixel_frame(pixels, card.images)
            frames.extend(pixel_frames)
        inline = protocol.media_frame(media or [])
        frames.extend(inline.frames)
        loop = asyncio.get_running_loop()
        request_ids = [next(self._ids) for _ in ids]
        futures = [loop.create_future() for _ in ids]
        for request_id, future in zip(request_ids, futures, strict=True):
            self._pending[request_id] = future
            self._id_of[future] = request_id
        self._send(
            Submit(
                request_ids,
                lengths,
                params,
                priority,
                typed,
                image_flags,
                grids,
                inline.counts,
                inline.grids,
                inline.digests,
            ),
            frames,
        )
        return futures

    def cancel_future(self, future: asyncio.Future[PoolingOutput]) -> None:
        """Cancel the request behind a future: the core frees its work."""
        request_id = self._forget(future)
        if request_id is None:
            return
        if not future.done():
            future.cancel()
        if self.dead_reason is None:
            self._send(Cancel([request_id]))

    async def snapshot(self) -> EngineSnapshot:
        """The engine's gauges and counters now (a round trip to the core)."""
        token = next(self._ids)
        reply = self._expect(token)
        self._send(Query(token))
        try:
            answer = await asyncio.wait_for(reply, QUERY_TIMEOUT_S)
        except BaseException:
            self._replies.pop(token, None)
            self.last_snapshot = None  # stale counters are worse than none
            raise
        assert isinstance(answer, Snapshot)
        snapshot = pickle.loads(answer.payload)
        assert isinstance(snapshot, EngineSnapshot)
        self.last_snapshot = snapshot
        return snapshot

    async def adapt(self, name: str, path: str | None, base_model_name: str | None = None) -> None:
        """Load LoRA adapter `name` from `path` (None: unload it) in the engine; raises what
        the engine refused with. Every front end hears the new set (Adapters)."""
        token = next(self._ids)
        reply = self._expect(token)
        self._send(Adapt(token, name, path, base_model_name))
        try:
            answer = await reply
        finally:
            self._replies.pop(token, None)
        assert isinstance(answer, Adapted)
        if answer.error is not None:
            raise protocol.rebuild_error(answer.error)

    def latest_snapshot(self) -> EngineSnapshot | None:
        """The last snapshot fetched (what a /metrics scrape just asked for); None when dead."""
        return None if self.dead_reason is not None else self.last_snapshot

    # ---- receiving --------------------------------------------------------------------------
    def _on_message(
        self, stream: MessageStream, header: memoryview, frames: list[memoryview]
    ) -> None:
        self._last_heard = time.monotonic()
        message = protocol.decode_to_front_end(header)
        self._mirror(message.load)
        self._handlers[type(message)](message, frames)

    def _on_lost(self, stream: MessageStream, exc: Exception | None) -> None:
        if self.stream is not None and self.dead_reason is None:
            self.lose("the engine core's connection closed")

    def _on_adapters(self, message: Adapters, frames: list[memoryview]) -> None:
        """The engine's LoRA adapters changed: requests route by the new names from now on."""
        modules = tuple(LoraModule(name, path, base) for name, path, base in message.modules)
        if self._card is not None:
            self._card = dataclasses.replace(self._card, lora_modules=modules)
        self._mirror(message.load)

    def _on_reply(self, message: object, frames: list[memoryview]) -> None:
        key = REPLY_KEYS[type(message)](message)
        reply = self._replies.pop(key, None)
        if reply is not None and not reply.done():
            reply.set_result(message)

    def _on_results(self, message: Results, frames: list[memoryview]) -> None:
        for head, frame in zip(message.outputs, frames, strict=True):
            future = self._pending.pop(head.id, None)
            if future is None or future.done():
                continue
            self._id_of.pop(future, None)
            data = np.frombuffer(frame, dtype=np.dtype(head.dtype)).reshape(head.shape)
            timeline = None if head.timeline is None else pickle.loads(head.timeline)
            future.set_result(
                PoolingOutput(
                    head.id,
                    data,
                    head.num_prompt_tokens,
                    head.queue_time_s,
                    head.inference_time_s,
                    timeline,
                )
            )
        for request_id, error in message.failures:
            future = self._pending.pop(request_id, None)
            if future is not None and not future.done():
                self._id_of.pop(future, None)
                future.set_exception(protocol.rebuild_error(error))
        for request_id in message.cancelled:
            future = self._pending.pop(request_id, None)
            if future is not None:
                self._id_of.pop(future, None)
                future.cancel()

    def _mirror(self, load: Load) -> None:
        """The core's counters become this front end's view for the early 429."""
        if self._admission is not None:
            self._admission.mirror(
                load.queued_requests, load.queued_tokens, load.throughput_tokens_per_s
            )
        self.draining = load.draining
        self._loop_alive = load.alive
        if load.dead_reason is not None and self.dead_reason is None:
            logger.error("engine core: the engine stopped: %s", load.dead_reason)
            self.dead_reason = load.dead_reason  # what it still owes comes, failed by the engine

    # ---- death ------------------------------------------------------------------------------
    async def _watchdog(self) -> None:
        while True:
            await asyncio.sleep(min(1.0, self.timeout_s / 4))
            silent = time.monotonic() - self._last_heard
            if silent > self.timeout_s and self.dead_reason is None:
                self.lose(f"the engine core has not answered for {silent:.1f} s")

    def lose(self, reason: str) -> None:
        """The core itself is gone or mute: nothing it owes this front end will come."""
        logger.error("engine core lost: %s", reason)
        self._lost = True
        self.dead_reason = reason
        self._fail_all(EngineDeadError(reason))

    def _fail_all(self, error: Exception) -> None:
        for future in list(self._pending.values()):
            if not future.done():
                future.set_exception(error)
        for reply in self._replies.values():
            if not reply.done():
                reply.set_exception(error)
        self._pending.clear()
        self._id_of.clear()
        self._replies.clear()

    # ---- helpers ----------------------------------------------------------------------------
    def _expect(self, key: int) -> asyncio.Future[object]:
        if self.dead_reason is not None:
            raise EngineDeadError(self.dead_reason)
        reply: asyncio.Future[object] = asyncio.get_running_loop().create_future()
        self._replies[key] = reply
        return reply

    def _send(self, message: protocol.ToCore, frames: Sequence[object] = ()) -> None:
        assert self.stream is not None, "connect() first"
        self.stream.send(protocol.encode(message), frames)

    def _forget(self, future: asyncio.Future[PoolingOutput]) -> int | None:
        request_id = self._id_of.pop(future, None)
        if request_id is not None:
            self._pending.pop(request_id, None)
        return request_id
