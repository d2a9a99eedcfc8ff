"""SIGTERM on a real process: it exits within --shutdown-timeout + 2 s, whatever clients do."""

from __future__ import annotations

import signal
import socket
import subprocess
import threading
import time
from collections.abc import Callable
from pathlib import Path

import httpx
import orjson
import pytest

from tests.http.test_server_process import free_port, start_server

pytestmark = pytest.mark.slow
EXIT_MARGIN_S = 2.0  # the promise: exit within --shutdown-timeout plus this
ADMITTED = "poolserve_prompt_tokens_total"
PROMPT = list(range(1000, 1500))  # 500 token ids of the tiny llama's vocabulary


def _distinct(count: int) -> list[list[int]]:
    """count prompts of PROMPT's length with distinct first tokens: nothing for the prefix cache."""
    return [[1000 + i, *PROMPT[1:]] for i in range(count)]


def _serve(model_dir: Path, timeout_s: float, *args: str) -> tuple[subprocess.Popen[bytes], int]:
    port = free_port()
    process = start_server(
        port, "--model", str(model_dir), "--shutdown-timeout", str(timeout_s), *args
    )
    return process, port


def _post(port: int, path: str, body: dict[str, object]) -> bytes:
    payload = orjson.dumps(body)
    head = (
        f"POST {path} HTTP/1.1\r\nhost: localhost\r\ncontent-type: application/json\r\n"
        f"content-length: {len(payload)}\r\n\r\n"
    )
    return head.encode() + payload


def _connect(port: int, small_buffer: bool = False) -> socket.socket:
    sock = socket.socket()
    if small_buffer:  # so the server's writes back up after a few lines
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.connect(("127.0.0.1", port))
    return sock


def _metric(port: int, name: str) -> float:
    """The metric's value, summed over its models (one here)."""
    text = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=10).text
    values = [
        float(line.split()[-1])
        for line in text.splitlines()
        if line.startswith((name + " ", name + "{"))
    ]
    assert values, f"{name} not exported"
    return sum(values)


def _wait_for(condition: Callable[[], bool], what: str, timeout_s: float = 30) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, what
        time.sleep(0.05)


def _exit_time(process: subprocess.Popen[bytes]) -> tuple[int, float]:
    started = time.monotonic()
    process.send_signal(signal.SIGTERM)
    code = process.wait(60)
    return code, time.monotonic() - started


def test_stalled_clients_do_not_hold_the_exit(tiny_model_dir: Callable[[str], Path]) -> None:
    timeout_s = 2.0
    process, port = _serve(tiny_model_dir("llama"), timeout_s, "--max-num-batched-tokens", "64")
    sockets: list[socket.socket] = []
    try:
        # a streamed token_embed request of ~20 MB of JSON whose client never reads
        stalled = _connect(port, small_buffer=True)
        body = {"input": [PROMPT] * 60, "task": "token_embed", "stream": True}
        stalled.sendall(_post(port, "/v1/pooling", body))
        # an upload that stops after its headers and a few bytes
        upload = _connect(port)
        upload.sendall(_post(port, "/v1/embeddings", {"input": "x" * 1000})[:-900])
        # a keep-alive connection after one answered request, and one that never sent anything
        idle = _connect(port)
        idle.sendall(b"GET /health HTTP/1.1\r\nhost: localhost\r\n\r\n")
        assert idle.recv(4096).startswith(b"HTTP/1.1 200")
        silent = _connect(port)
        sockets += [stalled, upload, idle, silent]
        _wait_for(lambda: _metric(port, "poolserve_step_tokens_total") > 64 * 20, "no progress")
        time.sleep(1.0)  # the stream's lines back up in the socket buffers
        code, elapsed = _exit_time(process)
        assert code == 0
        assert elapsed <= timeout_s + EXIT_MARGIN_S, f"exit took {elapsed:.1f} s"
    finally:
        for sock in sockets:
            sock.close()
        if process.poll() is None:
            process.kill()


def test_the_deadline_answers_in_flight_requests(tiny_model_dir: Callable[[str], Path]) -> None:
    """A non-streamed request gets the JSON 503; a read stream ends with the error line."""
    timeout_s = 1.0
    # 16 tokens a step: these requests would take far longer than the drain allows
    process, port = _serve(tiny_model_dir("llama"), timeout_s, "--max-num-batched-tokens", "16")
    url = f"http://127.0.0.1:{port}"
    outcome: dict[str, object] = {}

    def unary() -> None:
        body = {"input": _distinct(150)}
        outcome["unary"] = httpx.post(f"{url}/v1/embeddings", json=body, timeout=60)

    def stream() -> None:
        body = {"input": _distinct(150), "task": "token_embed", "stream": True}
        with httpx.stream("POST", f"{url}/v1/pooling", json=body, timeout=60) as response:
            outcome["stream_status"] = response.status_code
            outcome["lines"] = list(response.iter_lines())

    threads = [threading.Thread(target=unary), threading.Thread(target=stream)]
    try:
        for thread in threads:
            thread.start()
        admitted = 2 * 150 * len(PROMPT)
        _wait_for(lambda: _metric(port, ADMITTED) >= admitted, "not admitted")
        code, elapsed = _exit_time(process)
        for thread in threads:
            thread.join(30)
        assert code == 0
        assert elapsed <= timeout_s + EXIT_MARGIN_S, f"exit took {elapsed:.1f} s"
    finally:
        if process.poll() is None:
            process.kill()
    unary_response = outcome["unary"]
    assert isinstance(unary_response, httpx.Response)
    assert unary_response.status_code == 503
    assert unary_response.json()["error"]["code"] == "shutdown"
    assert unary_response.headers["content-type"] == "application/json"
    assert outcome["stream_status"] == 200
    lines = outcome["lines"]
    assert isinstance(lines, list) and lines
    documents = [orjson.loads(line) for line in lines]  # every line whole JSON, none cut
    assert documents[-1]["error"]["code"] == "shutdown"
    assert all("error" not in d for d in documents[:-1])


def test_a_second_signal_exits_at_once(tiny_model_dir: Callable[[str], Path]) -> None:
    process, port = _serve(tiny_model_dir("llama"), 30.0, "--max-num-batched-tokens", "16")
    url = f"http://127.0.0.1:{port}"
    outcome: dict[str, object] = {}

    def unary() -> None:
        body = {"input": _distinct(150)}
        outcome["unary"] = httpx.post(f"{url}/v1/embeddings", json=body, timeout=60)

    thread = threading.Thread(target=unary)
    try:
        thread.start()
        admitted = 150 * len(PROMPT)
        _wait_for(lambda: _metric(port, ADMITTED) >= admitted, "not admitted")
        process.send_signal(signal.SIGTERM)
        time.sleep(0.5)
        assert process.poll() is None  # the first signal drains
        _, elapsed = _exit_time(process)
        assert elapsed <= EXIT_MARGIN_S, f"exit took {elapsed:.1f} s"
        thread.join(30)
    finally:
        if process.poll() is None:
            process.kill()
    response = outcome["unary"]
    assert isinstance(response, httpx.Response) and response.status_code == 503
