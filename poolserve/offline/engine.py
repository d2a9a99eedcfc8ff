"""`AsyncPoolingEngine`: the server's front end run in this process, called without HTTP.

The front end's own start-up (`frontend/startup.py`, which the app's lifespan runs too) loads the
model, starts the engine core on the caller's event loop and warms up; every call builds the same
job a route builds and sends it through the same pipeline (`submit_job`), so outputs equal the
server's, with no web framework loaded. A call with more inputs than one request may carry is
cut into pieces that run concurrently (continuous batching takes them together) and wait for
room when the engine's queue is full, instead of failing with the server's 429. Only `request()`
(a raw HTTP request) builds the app, on first use (`app_client.py`).
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Mapping, Sequence
from typing import Any, TypeVar, cast

import numpy as np

from poolserve.config.settings import ServerSettings
from poolserve.frontend.jobs import Requested, ScoreJob, TextJob, Truncate, TruncationSide
from poolserve.frontend.pipeline import check_serving, gather, submit_job
from poolserve.frontend.scoring import best_first, scores_of
from poolserve.frontend.startup import new_state, start, stop
from poolserve.frontend.state import ModelHandle, ServiceState
from poolserve.offline.app_client import AppClient, RequestBody
from poolserve.offline.late import late_chunking_of, late_piece, with_spans
from poolserve.offline.outputs import Classification, Pooled, Ranked, Reply
from poolserve.types.errors import OverloadedError, RequestTooLargeError
from poolserve.types.tasks import PoolingTask

T = TypeVar("T")

# Inputs per piece: enough for the engine to fill steps, few enough that a piece's tokenization
# (in a worker thread) overlaps the forwards of the pieces before it.
PIECE_INPUTS = 128
# Pieces in flight at once for the whole engine, whatever the number of concurrent calls.
PIECES_IN_FLIGHT = 8
# How long a piece refused for a full queue waits before it asks again.
RETRY_S = 0.01

Inputs = str | Sequence[str] | Sequence[Sequence[int]]


class AsyncPoolingEngine:
    """A model served in this process: `await engine.embed(texts)` and friends.

    Keyword arguments are `ServerSettings` fields (the flags of `poolserve serve`, e.g.
    `dtype="bfloat16"`, `max_model_len=512`, `pooler_config='{"normalize": false}'`);
    POOLSERVE_* variables apply as they do to the server. Use it as an async context manager,
    or call `start()` and `close()`.
    """

    def __init__(self, model: str | None = None, **settings: Any) -> None:
        if model is not None:
            settings["model"] = model
        self.settings = ServerSettings(**{**settings, "api_server_count": 0})
        self.state: ServiceState = new_state(self.settings)  # the server state calls run on
        self._slots: asyncio.Semaphore | None = None  # set while started
        self._app: AppClient | None = None  # built by the first request()
        self._opening = asyncio.Lock()

    @classmethod
    def from_settings(cls, settings: ServerSettings) -> AsyncPoolingEngine:
        """An engine with the settings a server would run (the CLI's jobs use this)."""
        return cls(**settings.model_dump(exclude_unset=True))

    async def start(self) -> None:
        """Load the model, start the engine and warm up (the server's start-up)."""
        try:
            await start(self.state)
        except BaseException as exc:
            self.state.start_failure = exc
            raise
        self._slots = asyncio.Semaphore(PIECES_IN_FLIGHT)

    async def close(self) -> None:
        """Stop the engine; work still queued is cancelled."""
        if self._slots is None:
            return
        self._slots = None
        try:
            if self._app is not None:  # the app's own parts first, as its lifespan stops them
                app, self._app = self._app, None
                await app.close()
        finally:
            await stop(self.state)

    async def __aenter__(self) -> AsyncPoolingEngine:
        await self.start()
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.close()

    @property
    def model(self) -> ModelHandle:
        """The default model: its name, tokenizer, limits and card."""
        return self.handle(None)

    def handle(self, name: str | None) -> ModelHandle:
        """The model served as `name` (None: the default model); unknown names are refused."""
        if self.state.default is None:
            raise RuntimeError("the engine is not started: use `async with` or await start()")
        return check_serving(self.state, name)[1]

    @property
    def supported_tasks(self) -> tuple[PoolingTask, ...]:
        """The tasks the model serves."""
        return self.state.supported_tasks

    async def encode(
        self,
        inputs: Inputs,
        task: PoolingTask | str,
        *,
        normalize: bool | None = None,
        dimensions: int | None = None,
        use_activation: bool | None = None,
        step_tag_id: int | None = None,
        returned_token_ids: Sequence[int] | None = None,
        truncate_prompt_tokens: int | None = None,
        truncation_side: TruncationSide | None = None,
        prompt_name: str | None = None,
        prompt: str | None = None,
        add_special_tokens: bool | None = None,
        priority: int = 0,
        late_chunking: Mapping[str, Any] | None = None,
        model: str | None = None,
    ) -> list[Pooled]:
        """Every input pooled for `task` (any of the model's tasks, token-level included).

        Inputs are texts or token-id lists; the options mean what `/v1/pooling`'s fields mean;
        `model` names one of the models served (the default model when None).
        `late_chunking` (task embed, texts) is the wire's object, `{"spans": [[(start, end),
        ...] per input]}` or `{"chunk_size": n}`: each input runs whole and its `Pooled.data`
        is `[num_spans, dim]`, one embedding per span in order.
        """
        task = PoolingTask(task)
        requested = Requested(
            dimensions=dimensions,
            normalize=normalize,
            use_activation=use_activation,
            step_tag_id=step_tag_id,
            returned_token_ids=None if returned_token_ids is None else tuple(returned_token_ids),
        )
        truncate = Truncate(truncate_prompt_tokens, truncation_side)
        late = None if late_chunking is None else late_chunking_of(late_chunking)

        async def piece(items: list[Any]) -> list[Pooled]:
            items, chunking = late_piece(items, late)
            job = TextJob(
                task,
                items,
                requested=requested,
                prompt_name=prompt_name,
                prompt=prompt,
                truncate=truncate,
                add_special_tokens=add_special_tokens,
                priority=priority,
                late_chunking=chunking,
                model=model,
            )
            outputs = await gather(await submit_job(self.state, job))
            return [Pooled(o.data, o.num_prompt_tokens) for o in outputs]

        return await self._pieces(with_spans(_as_inputs(inputs), late), piece, model)

    async def embed(
        self, inputs: Inputs, *, late_chunking: Mapping[str, Any] | None = None, **options: Any
    ) -> list[Pooled]:
        """One embedding per input; options as `encode`'s (`normalize`, `dimensions`, ...).

        With `late_chunking` (`{"spans": ...}` or `{"chunk_size": n}`, see `encode`) each
        input's `data` is `[num_spans, dim]`: one embedding per span, pooled from the whole text.
        """
        return await self.encode(inputs, PoolingTask.EMBED, late_chunking=late_chunking, **options)

    async def embed_array(self, inputs: Inputs, **options: Any) -> np.ndarray:
        """The embeddings as one `[inputs, dim]` float32 array."""
        pooled = await self.embed(inputs, **options)
        if not pooled:
            return np.zeros((0, 0), dtype=np.float32)
        return np.stack([p.data for p in pooled])

    async def classify(self, inputs: Inputs, **options: Any) -> list[Classification]:
        """Class probabilities and the best label of each input (`use_activation=False`: logits)."""
        pooled = await self.encode(inputs, PoolingTask.CLASSIFY, **options)
        model = self.handle(options.get("model"))
        return [Classification(p.data, model.label_of(p.data), p.prompt_tokens) for p in pooled]

    async def score(
        self,
        queries: str | Sequence[str],
        documents: str | Sequence[str],
        *,
        use_activation: bool | None = None,
        truncate_prompt_tokens: int | None = None,
        truncation_side: TruncationSide | None = None,
        priority: int = 0,
        model: str | None = None,
    ) -> list[float]:
        """vLLM's /score: one query against each document, or query i against document i
        (`model`: one of the models served, the default when None)."""
        firsts, seconds = _texts(queries, "queries"), _texts(documents, "documents")
        if len(firsts) > 1 and len(firsts) != len(seconds):
            raise ValueError(
                f"{len(firsts)} queries and {len(seconds)} documents: pair them 1:1, 1:N or N:N"
            )
        truncate = Truncate(truncate_prompt_tokens, truncation_side)

        async def piece(indices: list[int]) -> list[float]:
            one = len(firsts) == 1
            chosen = firsts if one else tuple(firsts[i] for i in indices)
            pairs = tuple((0 if one else n, n) for n in range(len(indices)))
            job = ScoreJob(
                chosen,
                tuple(seconds[i] for i in indices),
                pairs,
                "queries",
                "documents",
                truncate=truncate,
                use_activation=use_activation,
                priority=priority,
                model=model,
            )
            return list((await scores_of(job, await submit_job(self.state, job))).scores)

        return await self._pieces(list(range(len(seconds))), piece, model)

    async def rerank(
        self, query: str, documents: Sequence[str], *, top_n: int = 0, **options: Any
    ) -> list[Ranked]:
        """The documents best first (equal scores keep their order), the `top_n` best (0: all)."""
        documents = _texts(documents, "documents")
        scores = await self.score(query, documents, **options)
        return [Ranked(i, scores[i], documents[i]) for i in best_first(scores, top_n)]

    async def request(
        self,
        method: str,
        path: str,
        body: RequestBody = None,
        headers: dict[str, str] | None = None,
    ) -> Reply:
        """One HTTP request answered by the in-process server, exactly as it would over a socket;
        a dict `body` is sent as its JSON, bytes and text as they are. The first call builds the
        server's app on this engine's state (FastAPI and httpx load then)."""
        app = self._app if self._app is not None else await self._open_app()
        return await app.request(method, path, body, headers)

    async def _open_app(self) -> AppClient:
        """The app, built once however many requests arrive before it is."""
        async with self._opening:
            if self._slots is None:
                raise RuntimeError("the engine is not started: use `async with` or await start()")
            if self._app is None:
                self._app = await AppClient.open(self.state)
            return self._app

    async def _pieces(
        self,
        items: list[Any],
        run: Callable[[list[Any]], Awaitable[list[T]]],
        name: str | None,
    ) -> list[T]:
        """`run` over pieces of `items`, concurrently within the engine's slots, in order
        (pieces sized by the limits of the model served as `name`)."""
        slots = self._slots
        if slots is None:
            raise RuntimeError("the engine is not started: use `async with` or await start()")
        model = self.handle(name)
        # a piece fits the engine's queue alone (half of it: other pieces keep it busy)
        most = max(1, min(PIECE_INPUTS, model.card.scheduler.max_num_queued_requests // 2))

        async def one(piece: list[Any]) -> list[T]:
            async with slots:
                while True:
                    try:
                        return await run(piece)
                    except OverloadedError:  # the queue is full: wait for room, not a 429
                        await asyncio.sleep(RETRY_S)
                    except RequestTooLargeError:
                        if len(piece) == 1:  # one prompt above the queue's limits: its error
                            raise
                        break
            # more tokens than the queue holds: halves, each on its own slot
            half = len(piece) // 2
            first, second = await _gather_all([one(piece[:half]), one(piece[half:])])
            return first + second

        pieces = _split(items, most, model.limits.max_request_chars)
        results = await _gather_all([one(p) for p in pieces])
        return [value for part in results for value in part]


async def _gather_all(calls: list[Awaitable[list[T]]]) -> list[list[T]]:
    """Every call's result in order; the first failure cancels the others and raises."""
    tasks = [asyncio.ensure_future(call) for call in calls]
    try:
        return list(await asyncio.gather(*tasks))
    finally:
        for task in tasks:
            task.cancel()


def _split(items: list[Any], most: int, chars: int) -> list[list[Any]]:
    """Consecutive pieces of at most `most` items and, for texts, `chars` characters."""
    pieces: list[list[Any]] = []
    piece: list[Any] = []
    size = 0
    for item in items:
        text = item[0] if isinstance(item, tuple) else item  # (text, spans) with late chunking
        length = len(text) if isinstance(text, str) else 0
        if piece and (len(piece) == most or size + length > chars):
            pieces.append(piece)
            piece, size = [], 0
        piece.append(item)
        size += length
    if piece:
        pieces.append(piece)
    return pieces


def _as_inputs(inputs: Inputs) -> list[Any]:
    """Texts or token-id lists, checked as a request body's `input` is."""
    if isinstance(inputs, str):
        return [inputs]
    items = list(inputs)
    if all(isinstance(item, str) for item in items):
        return items
    for item in items:
        if isinstance(item, str) or not all(
            isinstance(t, (int, np.integer)) and not isinstance(t, bool) for t in item
        ):
            raise TypeError("inputs must be texts or lists of token ids, not a mix")
    return [[int(t) for t in cast(Sequence[int], item)] for item in items]


def _texts(texts: str | Sequence[str], name: str) -> tuple[str, ...]:
    """One text or several, all strings."""
    values = (texts,) if isinstance(texts, str) else tuple(texts)
    if not all(isinstance(text, str) for text in values):
        raise TypeError(f"{name} must be texts")
    return values
