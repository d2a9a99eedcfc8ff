"""`--api-server-count`: an engine-core process and front-end processes behind one port.

Real `poolserve serve` processes: outputs equal sentence-transformers' whichever front end
answers, one /metrics for the whole server, SIGTERM drains every front end and then the core
(exit 0), and a lost engine core or front end takes the server down non-zero, leaving nothing
running.
"""

from __future__ import annotations

import base64
import copy
import signal
import socket
import subprocess
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import numpy as np
import orjson
import psutil
import pytest
import torch
from peft import LoraConfig, get_peft_model
from prometheus_client.parser import text_string_to_metric_families
from sentence_transformers import SentenceTransformer
from transformers import AutoModel

from tests.deploy.tools import huge_pages_mib, maps_library, require_tcmalloc, thp_mode
from tests.http.test_server_process import free_port, start_server
from tests.tiny_models import MINILM_DIR

pytestmark = pytest.mark.slow
TEXTS = [f"text {i} about {word}" for i, word in enumerate(["cats", "ships", "rain"] * 8)]


def _children(process: subprocess.Popen[bytes]) -> tuple[psutil.Process, list[psutil.Process]]:
    """(the engine core, the front ends) of a server: front ends hold the listening socket."""
    children = [
        child
        for child in psutil.Process(process.pid).children()
        if "resource_tracker" not in " ".join(child.cmdline())
    ]
    listening = {
        child.pid
        for child in children
        if any(c.status == psutil.CONN_LISTEN for c in child.net_connections(kind="tcp"))
    }
    cores = [child for child in children if child.pid not in listening]
    assert len(cores) == 1, children
    return cores[0], [child for child in children if child.pid in listening]


def _gone(processes: list[psutil.Process], timeout_s: float) -> bool:
    _, alive = psutil.wait_procs(processes, timeout=timeout_s)
    return not alive


@pytest.fixture(scope="module")
def two_front_ends() -> Iterator[tuple[str, subprocess.Popen[bytes]]]:
    port = free_port()
    process = start_server(
        port, "--served-model-name", "minilm", "--api-server-count", "2", "--enable-lora"
    )
    try:
        yield f"http://127.0.0.1:{port}", process
    finally:
        if process.poll() is None:
            process.kill()
            process.wait(10)


def test_two_front_ends_and_one_core_run(
    two_front_ends: tuple[str, subprocess.Popen[bytes]],
) -> None:
    core, front_ends = _children(two_front_ends[1])
    assert len(front_ends) == 2 and core.is_running()
    # glibc, tcmalloc only when asked for (--core-malloc); the core alone advises huge pages
    assert not any(maps_library(child.pid, "tcmalloc") for child in (core, *front_ends))
    if thp_mode() == "madvise":
        assert huge_pages_mib(core.pid) > 0
        assert [huge_pages_mib(front_end.pid) for front_end in front_ends] == [0, 0]


def test_a_core_on_tcmalloc_runs_it_alone_and_answers_as_the_reference() -> None:
    """--core-malloc tcmalloc: the core, and it alone, runs on the preloaded library, and its
    embeddings are sentence-transformers' within the float32 tolerance, as every server's here
    (not bit for bit: against the default server, the last digits differed in one run)."""
    require_tcmalloc()
    port = free_port()
    process = start_server(port, "--served-model-name", "minilm", "--core-malloc", "tcmalloc")
    try:
        core, front_ends = _children(process)
        assert maps_library(core.pid, "tcmalloc")
        assert not any(maps_library(front_end.pid, "tcmalloc") for front_end in front_ends)
        body = {"input": TEXTS, "encoding_format": "base64"}
        data = httpx.post(f"http://127.0.0.1:{port}/v1/embeddings", json=body, timeout=60)
        got = [np.frombuffer(base64.b64decode(d["embedding"]), "<f4") for d in data.json()["data"]]
    finally:
        process.terminate()
        process.wait(30)
    reference = SentenceTransformer(str(MINILM_DIR), device="cpu").encode(TEXTS)
    assert len(got) == len(TEXTS)
    for row, want in zip(got, reference, strict=True):
        np.testing.assert_allclose(row, want, atol=1e-5)


def test_connections_spread_over_the_front_ends(
    two_front_ends: tuple[str, subprocess.Popen[bytes]],
) -> None:
    """A burst of keep-alive connections lands on both front ends, not on whichever woke first
    (which, on one shared socket, accepts the whole burst in one loop)."""
    url, process = two_front_ends
    port = int(url.rsplit(":", 1)[1])
    _, front_ends = _children(process)
    body = b'{"input": "a"}'
    head = "POST /v1/embeddings HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
    request = f"{head}content-length: {len(body)}\r\n\r\n".encode() + body
    # connected in a burst, as a load generator opens them: all queue before any is accepted
    connections = [socket.create_connection(("127.0.0.1", port)) for _ in range(64)]
    try:
        for connection in connections:
            connection.sendall(request)
        for connection in connections:
            connection.settimeout(60)
            assert connection.recv(65536).startswith(b"HTTP/1.1 200")
        held = [
            sum(
                c.status == psutil.CONN_ESTABLISHED and c.laddr.port == port
                for c in front_end.net_connections(kind="tcp")
            )
            for front_end in front_ends
        ]
        assert sum(held) == 64 and min(held) >= 16, held  # binomial(64, 1/2) < 16: p ~ 3e-5
    finally:
        for connection in connections:
            connection.close()


def test_outputs_equal_sentence_transformers_under_concurrency(
    two_front_ends: tuple[str, subprocess.Popen[bytes]],
) -> None:
    url = two_front_ends[0]
    reference = SentenceTransformer(str(MINILM_DIR), device="cpu").encode(TEXTS)

    def embed(i: int) -> tuple[int, np.ndarray]:
        with httpx.Client(timeout=60) as client:  # a connection each: both front ends serve
            body = {"input": TEXTS[i], "encoding_format": "base64"}
            data = client.post(f"{url}/v1/embeddings", json=body).json()["data"][0]
        return i, np.frombuffer(base64.b64decode(data["embedding"]), "<f4")

    with ThreadPoolExecutor(12) as pool:
        results = list(pool.map(embed, list(range(len(TEXTS))) * 3))
    for i, got in results:
        np.testing.assert_allclose(got, reference[i], atol=1e-5)


def test_an_adapter_loaded_through_one_front_end_is_served_by_every_one(
    two_front_ends: tuple[str, subprocess.Popen[bytes]], tmp_path: Path
) -> None:
    """The core tells every front end of a load and an unload: requests on fresh connections
    (spread over both front ends) reach the adapter, equal to sentence-transformers over PEFT's
    merged model; after the unload every front end answers 404."""
    url = two_front_ends[0]
    base = AutoModel.from_pretrained(MINILM_DIR)
    config = LoraConfig(r=4, lora_alpha=8, target_modules=["query", "value", "output.dense"])
    adapted = get_peft_model(copy.deepcopy(base), config)
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, param in adapted.named_parameters():
            if "lora_" in name:
                param.copy_(torch.randn(param.shape, generator=gen) * 0.05)
    adapted.save_pretrained(tmp_path / "tuned")
    reference = SentenceTransformer(str(MINILM_DIR), device="cpu")
    reference[0].model = adapted.merge_and_unload().eval()
    want = reference.encode(TEXTS)
    load = {"lora_name": "tuned", "lora_path": str(tmp_path / "tuned")}
    assert httpx.post(f"{url}/v1/load_lora_adapter", json=load, timeout=60).status_code == 200

    def embed(i: int) -> tuple[int, int, np.ndarray | None]:
        with httpx.Client(timeout=60) as client:  # a connection each: both front ends serve
            body = {"model": "tuned", "input": TEXTS[i], "encoding_format": "base64"}
            response = client.post(f"{url}/v1/embeddings", json=body)
        if response.status_code != 200:
            return i, response.status_code, None
        data = response.json()["data"][0]["embedding"]
        return i, 200, np.frombuffer(base64.b64decode(data), "<f4")

    with ThreadPoolExecutor(8) as pool:
        results = list(pool.map(embed, range(len(TEXTS))))
    for i, status, got in results:
        assert status == 200 and got is not None
        np.testing.assert_allclose(got, want[i], atol=1e-5)
    unload = {"lora_name": "tuned"}
    assert httpx.post(f"{url}/v1/unload_lora_adapter", json=unload, timeout=60).status_code == 200
    with ThreadPoolExecutor(8) as pool:
        assert {status for _, status, _ in pool.map(embed, range(len(TEXTS)))} == {404}


def test_streamed_token_embeddings_equal_sentence_transformers(
    two_front_ends: tuple[str, subprocess.Popen[bytes]],
) -> None:
    url = two_front_ends[0]
    texts = [" ".join(f"word{i}" for i in range(120)), *TEXTS[:3]]
    model = SentenceTransformer(str(MINILM_DIR), device="cpu")
    reference = model.encode(texts, output_value="token_embeddings")
    body = {"input": texts, "task": "token_embed", "stream": True, "encoding_format": "base64"}
    with httpx.stream("POST", f"{url}/v1/pooling", json=body, timeout=60) as response:
        assert response.headers["content-type"].startswith("application/x-ndjson")
        lines = [orjson.loads(line) for line in response.iter_lines() if line]
    *items, usage = lines
    assert sorted(item["index"] for item in items) == list(range(len(texts)))
    assert usage["usage"]["prompt_tokens"] == sum(len(r) for r in reference)
    for item in items:
        got = np.frombuffer(base64.b64decode(item["data"]), "<f4").reshape(item["shape"])
        want = reference[item["index"]].numpy()
        want = want / np.linalg.norm(want, axis=-1, keepdims=True)  # token_embed normalizes rows
        np.testing.assert_allclose(got, want, atol=1e-5)


def _samples(url: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    # a new connection per scrape: any front end may answer
    text = httpx.get(f"{url}/metrics", headers={"connection": "close"}).text
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def test_one_metrics_endpoint_counts_every_process(
    two_front_ends: tuple[str, subprocess.Popen[bytes]],
) -> None:
    url = two_front_ends[0]
    key = (
        "poolserve_requests_total",
        (
            ("endpoint", "/tokenize"),
            ("lora_name", ""),
            ("model_name", "minilm"),
            ("protocol", "http"),
            ("status", "200"),
            ("task", "none"),
        ),
    )
    before = _samples(url).get(key, 0.0)
    for i in range(20):
        with httpx.Client() as client:
            assert client.post(f"{url}/tokenize", json={"prompt": f"t {i}"}).status_code == 200
    scrapes = [_samples(url) for _ in range(6)]
    assert {s.get(key, 0.0) - before for s in scrapes} == {20.0}
    for samples in scrapes:
        # the core's step histogram and the engine's gauges, asked of the core at scrape time
        model = (("model_name", "minilm"),)
        assert samples[("poolserve_step_duration_seconds_count", model)] > 0
        assert samples[("poolserve_running_requests", model)] == 0
        assert samples[("poolserve_ready", model)] == 1


def test_sigterm_drains_every_front_end_then_the_core() -> None:
    port = free_port()
    process = start_server(
        port,
        "--api-server-count",
        "2",
        "--shutdown-timeout",
        "30",
        "--max-num-batched-tokens",
        "512",
    )
    url = f"http://127.0.0.1:{port}"
    core, front_ends = _children(process)
    texts = [f"sentence number {i} " * 20 for i in range(300)]
    outcome: dict[str, object] = {}

    def long_request() -> None:
        body = {"input": texts, "encoding_format": "base64"}
        outcome["response"] = httpx.post(f"{url}/v1/embeddings", json=body, timeout=120)

    thread = threading.Thread(target=long_request)
    thread.start()
    time.sleep(0.5)  # the request is in flight
    process.send_signal(signal.SIGTERM)
    thread.join(120)
    response = outcome["response"]
    assert isinstance(response, httpx.Response) and response.status_code == 200
    assert len(response.json()["data"]) == len(texts)
    assert process.wait(60) == 0
    assert _gone([core, *front_ends], 5)


def test_a_lost_engine_core_is_503_then_a_non_zero_exit() -> None:
    port = free_port()
    process = start_server(port, "--api-server-count", "2")
    url = f"http://127.0.0.1:{port}"
    core, front_ends = _children(process)
    core.kill()
    started = time.monotonic()
    statuses = set()
    while process.poll() is None and time.monotonic() - started < 15:
        try:
            response = httpx.post(f"{url}/v1/embeddings", json={"input": "x"}, timeout=5)
            statuses.add(response.status_code)
            if response.status_code == 503:  # then the front ends stop, refusing as they drain
                assert response.json()["error"]["code"] in {"engine_dead", "draining"}
        except httpx.TransportError:
            pass  # the server is stopping
        time.sleep(0.05)
    assert process.wait(15) not in (0, None)
    assert time.monotonic() - started < 15
    assert statuses <= {503}  # never a hang, never a 500
    assert _gone(front_ends, 5)


def test_a_lost_front_end_takes_the_server_down_loudly() -> None:
    port = free_port()
    process = start_server(port, "--api-server-count", "2")
    core, front_ends = _children(process)
    front_ends[0].kill()
    assert process.wait(30) not in (0, None)
    assert _gone([core, front_ends[1]], 5)


def test_a_killed_supervisor_leaves_nothing_running() -> None:
    port = free_port()
    process = start_server(port, "--api-server-count", "2", "--shutdown-timeout", "2")
    core, front_ends = _children(process)
    process.kill()  # SIGKILL: the supervisor gets no chance to stop its children
    process.wait(10)
    assert _gone([core, *front_ends], 15)
