"""A real `poolserve serve` process: the official openai client, concurrency, SIGTERM drain."""

from __future__ import annotations

import base64
import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import numpy as np
import openai
import orjson
import pytest
from sentence_transformers import SentenceTransformer

from tests.tiny_models import MINILM_DIR

pytestmark = pytest.mark.slow
TEXTS = [
    "the cat sat on the mat",
    "poolserve serves pooled outputs",
    "a third, longer sentence " * 5,
]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def start_server(
    port: int, *args: str, env: dict[str, str] | None = None, log: Path | None = None
) -> subprocess.Popen[bytes]:
    """Start `poolserve serve` and wait until /ready answers 200 (or fail clearly).

    The server's log goes to a file (never a pipe nobody reads, which would block the server
    once full); pass `log` to read it afterwards.
    """
    if log is None:
        handle, name = tempfile.mkstemp(prefix="poolserve-", suffix=".log")
        os.close(handle)
        log = Path(name)
    command = [sys.executable, "-m", "poolserve", "serve", "--port", str(port), *args]
    with log.open("wb") as sink:
        process = subprocess.Popen(
            command,
            env={**os.environ, "HF_HUB_OFFLINE": "1", **(env or {})},
            stdout=subprocess.DEVNULL,
            stderr=sink,
            cwd=Path(__file__).resolve().parents[2],
        )
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise AssertionError(f"server exited early: {log.read_text()[-2000:]}")
        try:
            if httpx.get(f"http://127.0.0.1:{port}/ready", timeout=1).status_code == 200:
                return process
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    process.kill()
    raise AssertionError("server did not become ready within 120 s")


@pytest.fixture(scope="module")
def server() -> Iterator[str]:
    port = free_port()
    process = start_server(port, "--served-model-name", "minilm", "--shutdown-timeout", "20")
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        if process.poll() is None:
            process.kill()
            process.wait(10)


def test_openai_client_float_and_base64_concurrently(server: str) -> None:
    reference = SentenceTransformer(str(MINILM_DIR), device="cpu").encode(TEXTS)
    client = openai.OpenAI(base_url=f"{server}/v1", api_key="unused", max_retries=0)

    def embed(fmt: str) -> list[object]:
        result = client.embeddings.create(model="minilm", input=TEXTS, encoding_format=fmt)  # type: ignore[arg-type]
        # an explicit base64 request hands back the raw string; the client decodes only its default
        return [
            np.frombuffer(base64.b64decode(d.embedding), "<f4") if fmt == "base64" else d.embedding
            for d in result.data
        ]

    with ThreadPoolExecutor(8) as pool:
        results = list(pool.map(embed, ["float", "base64"] * 8))
    for vectors in results:
        got = np.asarray(vectors, dtype=np.float32)
        assert np.abs(got - reference).max() <= 1e-4 * np.abs(reference).max()
    # the client's default (no encoding_format) is base64 under the hood
    default = client.embeddings.create(model="minilm", input=TEXTS[0]).data[0].embedding
    assert np.abs(np.asarray(default) - reference[0]).max() <= 1e-4


def test_sigterm_lets_the_inflight_request_finish_and_exits_zero() -> None:
    port = free_port()
    process = start_server(port, "--shutdown-timeout", "30", "--max-num-batched-tokens", "512")
    url = f"http://127.0.0.1:{port}"
    texts = [f"sentence number {i} " * 20 for i in range(400)]
    outcome: dict[str, object] = {}

    def long_request() -> None:
        body = {"input": texts, "encoding_format": "base64"}
        outcome["response"] = httpx.post(f"{url}/v1/embeddings", json=body, timeout=120)

    thread = threading.Thread(target=long_request)
    thread.start()
    deadline = time.monotonic() + 60
    # the request is in flight: its inputs are in the engine (a fixed sleep was not enough on a
    # loaded machine, where the request could still be on its way when SIGTERM came)
    while _metric(url, "poolserve_running_requests") + _metric(url, "poolserve_queued_tokens") == 0:
        assert time.monotonic() < deadline, "the long request never reached the engine"
        time.sleep(0.02)
    process.send_signal(signal.SIGTERM)
    time.sleep(0.2)
    try:
        refused = httpx.post(f"{url}/v1/embeddings", json={"input": "late"}, timeout=10)
        assert refused.status_code == 503
    except httpx.TransportError:
        pass  # the server may already have finished the drain and closed its socket
    thread.join(120)
    response = outcome["response"]
    assert isinstance(response, httpx.Response) and response.status_code == 200
    data = response.json()["data"]
    assert len(data) == len(texts)
    assert len(base64.b64decode(data[0]["embedding"])) == 384 * 4
    assert process.wait(60) == 0


def _metric(url: str, name: str) -> float:
    """The metric's value, summed over its models (one here)."""
    lines = httpx.get(f"{url}/metrics", timeout=10).text.splitlines()
    values = [
        float(line.split()[-1]) for line in lines if line.startswith((name + " ", name + "{"))
    ]
    assert values, f"{name} not exported"
    return sum(values)


def test_a_disconnected_client_frees_its_work(server: str) -> None:
    text = "a sentence that is long enough to take a while to embed " * 6
    num_tokens = int(httpx.post(f"{server}/tokenize", json={"prompt": text}).json()["count"])
    # a body well above uvicorn's 64 KiB read pause, under --max-num-queued-requests
    inputs = 1000
    body = orjson.dumps({"input": [text] * inputs})
    steps_before = _metric(server, "poolserve_step_tokens_total")
    host, port = server.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port))) as sock:
        head = (
            f"POST /v1/embeddings HTTP/1.1\r\nhost: {host}\r\ncontent-type: application/json\r\n"
            f"content-length: {len(body)}\r\n\r\n"
        )
        sock.sendall(head.encode() + body)
        deadline = time.monotonic() + 30
        while _metric(server, "poolserve_step_tokens_total") == steps_before:
            assert time.monotonic() < deadline, "the request never started"
            time.sleep(0.02)
    # the client is gone: its queued inputs must be dropped long before all of them could run
    deadline = time.monotonic() + 30
    while _metric(server, "poolserve_queued_tokens") > 0:
        assert time.monotonic() < deadline, "work of a disconnected client was not freed"
        time.sleep(0.05)
    ran = _metric(server, "poolserve_step_tokens_total") - steps_before
    assert ran < inputs * num_tokens / 2
    assert _metric(server, "poolserve_kv_blocks_used") == 0
    assert _metric(server, "poolserve_waiting_requests") == 0
