"""A bounded closed-loop load on /v1/embeddings that records every request's outcome.

Workers send the next request as soon as their previous one returns, in a thread of their own,
until stopped or until the request bound is reached. Every request is kept: its status or its
transport error, so a lost request is counted with its reason, never dropped from the tally.
"""

from __future__ import annotations

import asyncio
import collections
import random
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass

import httpx
import orjson

from bench.common.loadgen import percentile_ms

WORDS = (
    "replica",
    "balancer",
    "pooling",
    "embedding",
    "token",
    "restart",
    "drain",
    "queue",
    "batch",
    "latency",
    "throughput",
    "vector",
    "sentence",
    "model",
    "request",
    "answer",
)
REQUEST_TIMEOUT_S = 120.0
DETAIL_CHARS = 200


@dataclass(frozen=True)
class Outcome:
    """One request: when it started, how long it took, what came back."""

    started_s: float  # since the load started
    latency_s: float
    status: int | None  # None: no HTTP answer (transport error)
    error: str | None  # None for a 200 holding one embedding per input
    prompt_tokens: int
    detail: str = ""  # the start of a failed answer's body, or the transport error's text

    @property
    def ok(self) -> bool:
        """A complete, correct answer."""
        return self.error is None


@dataclass(frozen=True)
class LoadSummary:
    """What a load run measured."""

    sent: int
    failed: int
    failures: dict[str, int]  # reason -> count
    wall_s: float
    tokens_per_s: float
    p50_ms: float
    p99_ms: float


def summarize(outcomes: Sequence[Outcome], wall_s: float) -> LoadSummary:
    """Counts, reasons, throughput and latency of the successful requests."""
    good = [o for o in outcomes if o.ok]
    reasons = collections.Counter(o.error for o in outcomes if o.error is not None)
    latencies = [o.latency_s for o in good]
    return LoadSummary(
        sent=len(outcomes),
        failed=len(outcomes) - len(good),
        failures=dict(reasons),
        wall_s=wall_s,
        tokens_per_s=sum(o.prompt_tokens for o in good) / wall_s if wall_s > 0 else 0.0,
        p50_ms=percentile_ms(latencies, 0.5),
        p99_ms=percentile_ms(latencies, 0.99),
    )


def make_bodies(count: int, inputs_per_request: int, seed: int = 0) -> list[tuple[bytes, int]]:
    """Distinct request bodies of a few sentences of 12-40 words each."""
    rng = random.Random(seed)
    bodies = []
    for index in range(count):
        texts = [
            f"request {index} " + " ".join(rng.choices(WORDS, k=rng.randint(12, 40)))
            for _ in range(inputs_per_request)
        ]
        bodies.append((orjson.dumps({"input": texts}), inputs_per_request))
    return bodies


def _error_of(response: httpx.Response, expected: int) -> str | None:
    if response.status_code != 200:
        return f"http {response.status_code}"
    try:
        data = orjson.loads(response.content)["data"]
    except (orjson.JSONDecodeError, KeyError, TypeError):
        return "malformed body"
    return None if len(data) == expected else "wrong number of embeddings"


class ClosedLoop:
    """`concurrency` workers posting to `url` until stop() or `max_requests` sent."""

    def __init__(
        self, url: str, concurrency: int, inputs_per_request: int = 4, max_requests: int = 100_000
    ) -> None:
        self.url = url
        self.concurrency = concurrency
        self.bodies = make_bodies(512, inputs_per_request)
        self.max_requests = max_requests
        self.outcomes: list[Outcome] = []
        self.stopping = threading.Event()
        self.thread = threading.Thread(target=lambda: asyncio.run(self._run()), daemon=True)
        self.origin = 0.0
        self.wall_s = 0.0

    def start(self) -> ClosedLoop:
        """Start the workers."""
        self.origin = time.perf_counter()
        self.thread.start()
        return self

    def stop(self) -> LoadSummary:
        """Let every request in flight finish, then summarize."""
        self.stopping.set()
        self.thread.join()
        return summarize(self.outcomes, self.wall_s)

    def since(self, start_s: float) -> list[Outcome]:
        """Outcomes of the requests started after `start_s` (seconds since the load started)."""
        return [o for o in self.outcomes if o.started_s >= start_s]

    def now(self) -> float:
        """Seconds since the load started."""
        return time.perf_counter() - self.origin

    async def _run(self) -> None:
        limits = httpx.Limits(max_connections=self.concurrency)
        timeout = httpx.Timeout(REQUEST_TIMEOUT_S, connect=10.0)
        counter = iter(range(self.max_requests))
        async with httpx.AsyncClient(limits=limits, timeout=timeout) as client:
            await asyncio.gather(*(self._worker(client, counter) for _ in range(self.concurrency)))
        self.wall_s = time.perf_counter() - self.origin

    async def _worker(
        self, client: httpx.AsyncClient, counter: collections.abc.Iterator[int]
    ) -> None:
        for index in counter:
            if self.stopping.is_set():
                return
            payload, expected = self.bodies[index % len(self.bodies)]
            start = time.perf_counter()
            status, error, tokens, detail = None, None, 0, ""
            try:
                response = await client.post(
                    self.url, content=payload, headers={"content-type": "application/json"}
                )
                status, error = response.status_code, _error_of(response, expected)
                if error is None:
                    tokens = int(orjson.loads(response.content)["usage"]["prompt_tokens"])
                else:
                    detail = response.text[:DETAIL_CHARS]
            except httpx.HTTPError as exc:
                error, detail = type(exc).__name__, str(exc)[:DETAIL_CHARS]
            end = time.perf_counter()
            self.outcomes.append(
                Outcome(start - self.origin, end - start, status, error, tokens, detail)
            )
