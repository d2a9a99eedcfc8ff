"""One async HTTP load generator for every server: fixed request count, bounded time.

Each point sends `num_requests` bodies to `POST {base_url}{path}` from `concurrency` workers that
take the next body as soon as their previous request returns (closed loop). Workers stop taking
bodies once the point's time limit has passed, so a point never outlives it by more than one
request timeout. Prompt tokens are counted on the client with one tokenizer, identical for all
servers, so tokens/s compares servers that report usage differently (or not at all).
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
from collections.abc import Awaitable, Callable, Iterator, Sequence
from dataclasses import dataclass

import httpx
import orjson

logger = logging.getLogger(__name__)

REQUEST_TIMEOUT_S = 300.0


@dataclass(frozen=True)
class RequestBody:
    """One request's JSON body and its prompt tokens as counted on the client."""

    payload: bytes
    num_inputs: int
    num_tokens: int


@dataclass(frozen=True)
class LoadPoint:
    """One measurement: how many requests, how many in flight, at most how long."""

    concurrency: int
    num_requests: int
    time_limit_s: float


@dataclass(frozen=True)
class Sample:
    """One finished request: latency and whether the server answered 200 with data."""

    latency_s: float
    ok: bool
    num_tokens: int


@dataclass(frozen=True)
class PointResult:
    """What one point measured."""

    concurrency: int
    inputs_per_request: int
    sent: int
    errors: int
    wall_s: float
    tokens: int  # prompt tokens of the successful requests
    p50_ms: float
    p99_ms: float

    @property
    def requests_per_s(self) -> float:
        """Successful requests per wall second."""
        return (self.sent - self.errors) / self.wall_s

    @property
    def tokens_per_s(self) -> float:
        """Prompt tokens of successful requests per wall second."""
        return self.tokens / self.wall_s


def percentile_ms(values: Sequence[float], q: float) -> float:
    """Nearest-rank percentile of seconds, in milliseconds (nan when empty)."""
    if not values:
        return float("nan")
    ordered = sorted(values)
    rank = min(len(ordered) - 1, max(0, round(q * len(ordered) + 0.5) - 1))
    return ordered[rank] * 1e3


def _check_body(status: int, content: bytes, expected: int) -> bool:
    """A 200 whose body holds one embedding per input."""
    if status != 200:
        return False
    try:
        data = orjson.loads(content).get("data")
    except (orjson.JSONDecodeError, AttributeError):
        return False
    return isinstance(data, list) and len(data) == expected


Poster = Callable[[bytes, int], Awaitable[bool]]


def _httpx_poster(client: httpx.AsyncClient, url: str) -> Poster:
    """A coroutine that posts one body and checks the answer."""

    async def post(payload: bytes, expected: int) -> bool:
        try:
            response = await client.post(
                url, content=payload, headers={"content-type": "application/json"}
            )
        except httpx.HTTPError as exc:
            logger.debug("request failed: %r", exc)
            return False
        return _check_body(response.status_code, response.content, expected)

    return post


async def _worker(
    post: Poster, bodies: Iterator[RequestBody], deadline: float, samples: list[Sample]
) -> None:
    """Send bodies one after another until they run out or the deadline passes."""
    for body in bodies:
        if time.perf_counter() > deadline:
            return
        start = time.perf_counter()
        ok = await post(body.payload, body.num_inputs)
        samples.append(Sample(time.perf_counter() - start, ok, body.num_tokens))


async def run_point(
    base_url: str, path: str, bodies: Sequence[RequestBody], point: LoadPoint
) -> PointResult:
    """Drive one point against a running server and summarize it."""
    limits = httpx.Limits(
        max_connections=point.concurrency, max_keepalive_connections=point.concurrency
    )
    # A request may wait behind the whole point's work: allow it the point's time and more.
    timeout = httpx.Timeout(max(REQUEST_TIMEOUT_S, 2 * point.time_limit_s), connect=30.0)
    chosen = list(itertools.islice(itertools.cycle(bodies), point.num_requests))
    samples: list[Sample] = []
    async with httpx.AsyncClient(limits=limits, timeout=timeout, base_url=base_url) as client:
        post = _httpx_poster(client, path)
        shared = iter(chosen)  # one iterator: each body is sent by exactly one worker
        start = time.perf_counter()
        deadline = start + point.time_limit_s
        await asyncio.gather(
            *(_worker(post, shared, deadline, samples) for _ in range(point.concurrency))
        )
        wall = time.perf_counter() - start
    good = [s for s in samples if s.ok]
    latencies = [s.latency_s for s in good]
    return PointResult(
        concurrency=point.concurrency,
        inputs_per_request=chosen[0].num_inputs if chosen else 0,
        sent=len(samples),
        errors=len(samples) - len(good),
        wall_s=wall,
        tokens=sum(s.num_tokens for s in good),
        p50_ms=percentile_ms(latencies, 0.5),
        p99_ms=percentile_ms(latencies, 0.99),
    )


async def wait_ready(base_url: str, path: str, timeout_s: float, alive: Callable[[], bool]) -> None:
    """Poll a GET route until it answers 200; fail when the process dies or time runs out."""
    deadline = time.perf_counter() + timeout_s
    async with httpx.AsyncClient(base_url=base_url, timeout=5.0) as client:
        while time.perf_counter() < deadline:
            if not alive():
                raise RuntimeError(f"server at {base_url} exited before it was ready")
            try:
                if (await client.get(path)).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            await asyncio.sleep(0.5)
    raise TimeoutError(f"server at {base_url} not ready after {timeout_s:.0f} s")
