"""`python -m bench grpc`: embeddings per second through TEI's gRPC `EmbedStream` against TEI's
HTTP `POST /embed`, on one server process (the bundled MiniLM, --grpc-port), in the same run.

Both sides keep the same number of texts outstanding: HTTP sends `batch` texts per /embed request
and waits for the answer; a gRPC client keeps `batch` messages of its stream unanswered (it sends
the next once an answer arrives). `--clients` of each run at once; the sides take turns, each
batch size measured for both before the next.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import sys
import tempfile
import time
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import grpc
import httpx

from bench.common.procs import free_port, spawn, wait_for
from poolserve.grpc import tei_pb2 as pb
from poolserve.grpc import tei_pb2_grpc as pb_grpc
from poolserve.models.cpu_class import cpu_class

logger = logging.getLogger(__name__)

WORDS = [
    "the",
    "quick",
    "brown",
    "fox",
    "jumps",
    "over",
    "a",
    "lazy",
    "dog",
    "while",
    "servers",
    "answer",
    "many",
    "small",
    "requests",
]


def texts(count: int) -> list[str]:
    """Sentences of 8 to 40 words, different enough that no cache helps."""
    return [
        " ".join(WORDS[(i + j) % len(WORDS)] for j in range(8 + i % 33)) + f" #{i}"
        for i in range(count)
    ]


@dataclass(frozen=True)
class Row:
    """One batch size's result on both sides."""

    batch: int
    http_per_s: float
    grpc_per_s: float


async def _http_client(client: httpx.AsyncClient, share: list[str], batch: int) -> None:
    for start in range(0, len(share), batch):
        answer = await client.post("/embed", json={"inputs": share[start : start + batch]})
        answer.raise_for_status()


async def run_http(base_url: str, items: list[str], batch: int, clients: int) -> float:
    """Embeddings per second over /embed."""
    limits = httpx.Limits(max_connections=clients)
    async with httpx.AsyncClient(base_url=base_url, timeout=120, limits=limits) as client:
        shares = [items[i::clients] for i in range(clients)]
        started = time.perf_counter()
        await asyncio.gather(*(_http_client(client, share, batch) for share in shares))
        return len(items) / (time.perf_counter() - started)


async def _grpc_client(stub: pb_grpc.EmbedStub, share: list[str], batch: int) -> None:
    window = asyncio.Semaphore(batch)

    async def requests() -> AsyncIterator[pb.EmbedRequest]:
        for text in share:
            await window.acquire()  # at most `batch` unanswered messages
            yield pb.EmbedRequest(inputs=text)

    answered = 0
    async for _ in stub.EmbedStream(requests()):
        answered += 1
        window.release()
    if answered != len(share):
        raise RuntimeError(f"EmbedStream answered {answered} of {len(share)} messages")


async def run_grpc(address: str, items: list[str], batch: int, clients: int) -> float:
    """Embeddings per second over EmbedStream, one stream (and channel) per client."""
    channels = [grpc.aio.insecure_channel(address) for _ in range(clients)]
    try:
        stubs = [pb_grpc.EmbedStub(channel) for channel in channels]
        shares = [items[i::clients] for i in range(clients)]
        started = time.perf_counter()
        await asyncio.gather(
            *(_grpc_client(stub, share, batch) for stub, share in zip(stubs, shares, strict=True))
        )
        return len(items) / (time.perf_counter() - started)
    finally:
        for channel in channels:
            await channel.close()


async def measure(
    base_url: str, address: str, batches: Sequence[int], count: int, clients: int
) -> list[Row]:
    """Each batch size on both sides, a warm-up pass first."""
    items = texts(count)
    await run_http(base_url, items[:64], 8, clients)
    await run_grpc(address, items[:64], 8, clients)
    rows = []
    for batch in batches:
        http_rate = await run_http(base_url, items, batch, clients)
        grpc_rate = await run_grpc(address, items, batch, clients)
        logger.info("batch %d: HTTP %.0f/s, gRPC %.0f/s", batch, http_rate, grpc_rate)
        rows.append(Row(batch, http_rate, grpc_rate))
    return rows


def table(rows: Sequence[Row]) -> str:
    """The markdown table docs/benchmarks.md shows."""
    lines = [
        "| texts outstanding per client | HTTP `/embed` embeddings/s | gRPC `EmbedStream` "
        "embeddings/s | gRPC / HTTP |",
        "|---:|---:|---:|---:|",
    ]
    for row in rows:
        ratio = row.grpc_per_s / row.http_per_s
        lines.append(f"| {row.batch} | {row.http_per_s:.0f} | {row.grpc_per_s:.0f} | {ratio:.2f} |")
    return "\n".join(lines)


def main(argv: Sequence[str]) -> None:
    """Start the server, measure, print the table."""
    parser = argparse.ArgumentParser(prog="python -m bench grpc", description=__doc__)
    parser.add_argument("--quick", action="store_true", help="fewer texts, two batch sizes")
    parser.add_argument("--count", type=int, default=2048, help="texts per measurement")
    parser.add_argument("--clients", type=int, default=4, help="concurrent clients per side")
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32])
    args = parser.parse_args(argv)
    count = 512 if args.quick else args.count
    batches = [1, 32] if args.quick else args.batches
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)  # not a line per request
    port, grpc_port = free_port(), free_port()
    command = [
        sys.executable,
        "-m",
        "poolserve",
        "serve",
        "--port",
        str(port),
        "--grpc-port",
        str(grpc_port),
        "--api-server-count",
        "1",
    ]
    log_path = Path(tempfile.mkdtemp(prefix="bench-grpc-")) / "server.log"
    base_url = f"http://127.0.0.1:{port}"
    with spawn(command, log_path):

        def ready() -> bool:
            try:
                return httpx.get(f"{base_url}/ready", timeout=2).status_code == 200
            except httpx.HTTPError:
                return False

        wait_for(ready, 180, "the server's /ready")
        address = f"127.0.0.1:{grpc_port}"
        rows = asyncio.run(measure(base_url, address, batches, count, args.clients))
    print(f"CPU: {cpu_class()}; {count} texts per measurement, {args.clients} clients per side")
    print(table(rows))


if __name__ == "__main__":
    main(sys.argv[1:])
