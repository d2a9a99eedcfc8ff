"""`PoolingEngine`: the blocking twin of `AsyncPoolingEngine`, for plain (non-async) Python.

The async engine runs on an event loop of its own in a background thread, so a blocking caller
(a script, a notebook whose loop is already running, a Ray actor) calls it from any thread;
calls from several threads at once are batched together by the engine.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Coroutine, Sequence
from concurrent.futures import Future
from typing import Any, TypeVar

import numpy as np

from poolserve.config.settings import ServerSettings
from poolserve.frontend.state import ModelHandle
from poolserve.offline.app_client import RequestBody
from poolserve.offline.engine import AsyncPoolingEngine, Inputs
from poolserve.offline.outputs import Classification, Pooled, Ranked, Reply
from poolserve.types.tasks import PoolingTask

T = TypeVar("T")


class PoolingEngine:
    """A model served in this process: `engine.embed(texts)` and friends, blocking.

    Arguments as `AsyncPoolingEngine`'s; the model loads in the constructor. Use it as a context
    manager or call `close()`.
    """

    def __init__(self, model: str | None = None, **settings: Any) -> None:
        self._start(AsyncPoolingEngine(model, **settings))

    @classmethod
    def from_settings(cls, settings: ServerSettings) -> PoolingEngine:
        """An engine with the settings a server would run."""
        engine = cls.__new__(cls)
        engine._start(AsyncPoolingEngine.from_settings(settings))
        return engine

    def _start(self, engine: AsyncPoolingEngine) -> None:
        self.engine = engine
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(
            target=self._loop.run_forever, name="poolserve-engine-loop", daemon=True
        )
        self._thread.start()
        try:
            self._call(engine.start())
        except BaseException:
            self._stop_loop()
            raise

    def _call(self, call: Coroutine[Any, Any, T]) -> T:
        """Run `call` on the engine's loop and wait; an interrupted wait cancels it."""
        future: Future[T] = asyncio.run_coroutine_threadsafe(call, self._loop)
        try:
            return future.result()
        except BaseException:
            future.cancel()
            raise

    def close(self) -> None:
        """Stop the engine and its loop thread."""
        if not self._thread.is_alive():
            return
        try:
            self._call(self.engine.close())
        finally:
            self._stop_loop()

    def _stop_loop(self) -> None:
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join()
        self._loop.close()

    def __enter__(self) -> PoolingEngine:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    @property
    def model(self) -> ModelHandle:
        """The served model: its name, tokenizer, limits and card."""
        return self.engine.model

    @property
    def supported_tasks(self) -> tuple[PoolingTask, ...]:
        """The tasks the model serves."""
        return self.engine.supported_tasks

    def encode(self, inputs: Inputs, task: PoolingTask | str, **options: Any) -> list[Pooled]:
        """As `AsyncPoolingEngine.encode`."""
        return self._call(self.engine.encode(inputs, task, **options))

    def embed(self, inputs: Inputs, **options: Any) -> list[Pooled]:
        """As `AsyncPoolingEngine.embed`."""
        return self._call(self.engine.embed(inputs, **options))

    def embed_array(self, inputs: Inputs, **options: Any) -> np.ndarray:
        """As `AsyncPoolingEngine.embed_array`."""
        return self._call(self.engine.embed_array(inputs, **options))

    def classify(self, inputs: Inputs, **options: Any) -> list[Classification]:
        """As `AsyncPoolingEngine.classify`."""
        return self._call(self.engine.classify(inputs, **options))

    def score(
        self, queries: str | Sequence[str], documents: str | Sequence[str], **options: Any
    ) -> list[float]:
        """As `AsyncPoolingEngine.score`."""
        return self._call(self.engine.score(queries, documents, **options))

    def rerank(self, query: str, documents: Sequence[str], **options: Any) -> list[Ranked]:
        """As `AsyncPoolingEngine.rerank`."""
        return self._call(self.engine.rerank(query, documents, **options))

    def request(
        self,
        method: str,
        path: str,
        body: RequestBody = None,
        headers: dict[str, str] | None = None,
    ) -> Reply:
        """As `AsyncPoolingEngine.request` (a dict body is sent as its JSON)."""
        return self._call(self.engine.request(method, path, body, headers))
