"""A storm of clients that go away mid-flight: their work is freed, nothing counts as a 500."""

from __future__ import annotations

import asyncio
import random
import signal
import time
from collections.abc import Callable
from pathlib import Path

import httpx
import orjson
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.http.test_server_process import free_port, start_server

pytestmark = pytest.mark.slow
NUM_CLIENTS = 200
LONG = list(range(1000, 1900))  # 900 token ids: chunked over many steps, holds KV blocks
GAUGES = (
    "poolserve_kv_blocks_used",
    "poolserve_waiting_requests",
    "poolserve_running_requests",
    "poolserve_queued_tokens",
    "poolserve_open_poolers",  # exported once poolers are counted; skipped while absent
)


def _request(kind: int) -> bytes:
    bodies: list[tuple[str, dict[str, object]]] = [
        ("/v1/pooling", {"input": [LONG[:200]] * 8, "task": "token_embed", "stream": True}),
        ("/v1/embeddings", {"input": [LONG] * 2}),
        ("/v1/embeddings", {"input": "a short one"}),
    ]
    path, body = bodies[kind % len(bodies)]
    payload = orjson.dumps(body)
    head = (
        f"POST {path} HTTP/1.1\r\nhost: localhost\r\ncontent-type: application/json\r\n"
        f"content-length: {len(payload)}\r\n\r\n"
    )
    return head.encode() + payload


async def _leave_early(port: int, kind: int, delay_s: float, reads: bool) -> None:
    """Send a request, maybe read a little, and close the socket before the answer is whole."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(_request(kind))
    await writer.drain()
    if reads:
        await asyncio.wait_for(reader.read(256), 30)
    await asyncio.sleep(delay_s)
    writer.transport.abort()  # a reset, as a killed client would leave it


async def _storm(port: int) -> None:
    rng = random.Random(0)
    clients = [
        _leave_early(port, i, rng.uniform(0.0, 0.3), reads=i % 3 == 0 and i % 2 == 0)
        for i in range(NUM_CLIENTS)
    ]
    await asyncio.gather(*clients)


def _samples(url: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    text = httpx.get(f"{url}/metrics", timeout=10).text
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def _gauges(url: str) -> dict[str, float]:
    gauges: dict[str, float] = {}
    for (name, _), value in _samples(url).items():  # summed over the models (one here)
        if name in GAUGES:
            gauges[name] = gauges.get(name, 0.0) + value
    return gauges


def _statuses(url: str) -> dict[str, float]:
    counts: dict[str, float] = {}
    for (name, labels), value in _samples(url).items():
        if name == "poolserve_requests_total":
            status = dict(labels)["status"]
            counts[status] = counts.get(status, 0.0) + value
    return counts


def test_a_disconnect_storm_frees_everything(
    tiny_model_dir: Callable[[str], Path], tmp_path: Path
) -> None:
    log = tmp_path / "server.log"
    port = free_port()
    process = start_server(
        port,
        "--model",
        str(tiny_model_dir("llama")),
        "--max-num-batched-tokens",
        "64",
        "--shutdown-timeout",
        "5",
        log=log,
    )
    url = f"http://127.0.0.1:{port}"
    try:
        asyncio.run(_storm(port))
        deadline = time.monotonic() + 60
        while any(_gauges(url).values()):
            assert time.monotonic() < deadline, f"work left behind: {_gauges(url)}"
            time.sleep(0.1)
        statuses = _statuses(url)
        assert "500" not in statuses, statuses
        assert statuses.get("499", 0) >= NUM_CLIENTS / 2, statuses
        assert httpx.post(f"{url}/v1/embeddings", json={"input": "still fine"}).status_code == 200
        process.send_signal(signal.SIGTERM)
        assert process.wait(30) == 0
    finally:
        if process.poll() is None:
            process.kill()
    text = log.read_text()
    assert "Traceback" not in text and "ERROR" not in text, text[-3000:]
    gone = text.count("client closed the connection before its answer")
    assert gone == statuses["499"]  # once per request, at info level
