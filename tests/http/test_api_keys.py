"""--api-keys-file: keys of many tenants at the edge. 401 for a missing or unknown key, 403 for a
route or model the key may not use, 429 with Retry-After when its requests per second or its
prompt tokens per minute are spent (before any work), usage per key name in the metrics and the
access log, never the key. Reloaded on SIGHUP by every front end of a real server, in-flight
requests untouched; a bad file keeps the keys read before.

The app in process answers most cases; one real `poolserve serve` with two front ends answers
the official openai client and the reloads.
"""

from __future__ import annotations

import hashlib
import logging
import math
import signal
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from poolserve.observability.logs import FIELDS_ATTR

SECRETS = {
    "open": "sk-open-0123456789",
    "hashed": "sk-hashed-0123456789",
    "elsewhere": "sk-elsewhere-0123456789",
    "tokens": "sk-tokens-0123456789",
    "rps": "sk-rps-0123456789",
    "default": "sk-default-0123456789",  # --api-key beside the file
}
TOKENS_PER_MINUTE = 12
KEYS_FILE = f"""
keys:
  - name: open
    key: {SECRETS["open"]}
  - name: hashed
    key: sha256:{hashlib.sha256(SECRETS["hashed"].encode()).hexdigest()}
    models: [llama]
    routes: [/v1/embeddings, /metrics]
  - name: elsewhere
    key: {SECRETS["elsewhere"]}
    models: [reranker]
  - name: tokens
    key: {SECRETS["tokens"]}
    tokens_per_minute: {TOKENS_PER_MINUTE}
  - name: rps
    key: {SECRETS["rps"]}
    requests_per_second: 0.2
    burst: 3
"""
LONG_TEXT = " ".join(f"word{i}" for i in range(40))  # more tokens than TOKENS_PER_MINUTE


def _auth(name: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {SECRETS[name]}"}


def _error(response: Any, status: int, code: str) -> dict[str, Any]:
    assert response.status_code == status, response.text
    error: dict[str, Any] = response.json()["error"]
    assert error["code"] == code, error
    return error


def _sample(metrics: str, series: str) -> float:
    for line in metrics.splitlines():
        if line.startswith(series + " "):
            return float(line.split()[1])
    return 0.0


@pytest.fixture(scope="module")
def keys_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("api-keys") / "keys.yaml"
    path.write_text(KEYS_FILE)
    return path


@pytest.fixture(scope="module")
def client(make_client: Callable[..., Any], keys_file: Path) -> Iterator[Any]:
    settings = {"api_keys_file": str(keys_file), "api_key": SECRETS["default"]}
    with make_client("llama", max_model_len=128, **settings) as c:
        yield c


@pytest.mark.parametrize("name", ["open", "hashed", "default"])
def test_a_good_key_is_served(client: Any, name: str) -> None:
    response = client.post("/v1/embeddings", json={"input": "a"}, headers=_auth(name))
    assert response.status_code == 200, response.text


@pytest.mark.parametrize(
    "authorization", [None, "Bearer sk-wrong", f"Basic {SECRETS['open']}", "Bearer "]
)
def test_a_missing_or_unknown_key_is_401(client: Any, authorization: str | None) -> None:
    headers = {} if authorization is None else {"Authorization": authorization}
    response = client.post("/v1/embeddings", json={"input": "a"}, headers=headers)
    assert _error(response, 401, "invalid_api_key")["type"] == "authentication_error"


@pytest.mark.parametrize("path", ["/health", "/ready", "/metrics", "/ping", "/version"])
def test_open_routes_need_no_key(client: Any, path: str) -> None:
    assert client.get(path).status_code == 200


def test_a_route_the_key_may_not_use_is_403(client: Any) -> None:
    response = client.post("/v1/pooling", json={"input": "a"}, headers=_auth("hashed"))
    error = _error(response, 403, "route_not_allowed")
    assert error["type"] == "permission_error"
    assert error["message"] == "this API key may not use /v1/pooling"
    # a prefix allows the route itself and what is under it, not a longer name
    response = client.post("/v1/embeddingsX", json={"input": "a"}, headers=_auth("hashed"))
    _error(response, 403, "route_not_allowed")


def test_a_model_the_key_may_not_use_is_403_before_any_work(client: Any) -> None:
    body = {"input": "a", "model": "llama"}
    response = client.post("/v1/embeddings", json=body, headers=_auth("elsewhere"))
    error = _error(response, 403, "model_not_allowed")
    assert (error["param"], error["message"]) == (
        "model",
        "this API key may not use the model 'llama'",
    )
    # no model named: the default model, the same answer; TEI's routes answer in TEI's shape
    response = client.post("/v1/embeddings", json={"input": "a"}, headers=_auth("elsewhere"))
    _error(response, 403, "model_not_allowed")
    tei = client.post("/embed", json={"inputs": "a"}, headers=_auth("elsewhere"))
    assert tei.status_code == 403 and "may not use the model" in tei.json()["error"]
    # an unknown name is a 404 that lists no served name to a key restricted to some models
    body = {"input": "a", "model": "reranker"}
    response = client.post("/v1/embeddings", json=body, headers=_auth("elsewhere"))
    error = _error(response, 404, "model_not_found")
    assert error["message"] == "model 'reranker' does not exist or this API key may not use it"
    metrics = client.get("/metrics").text
    series = 'poolserve_api_key_rejected_requests_total{key="elsewhere",reason="model"}'
    assert _sample(metrics, series) == 3.0


def test_requests_per_second_under_concurrent_load(client: Any) -> None:
    def tokenizations() -> float:
        series = 'poolserve_tokenization_duration_seconds_count{lora_name="",model_name="llama"}'
        return _sample(client.get("/metrics").text, series)

    before = tokenizations()
    started = time.monotonic()

    def embed(_: int) -> Any:
        return client.post("/v1/embeddings", json={"input": "a"}, headers=_auth("rps"))

    with ThreadPoolExecutor(8) as pool:
        answers = list(pool.map(embed, range(12)))
    elapsed = time.monotonic() - started
    served = [a for a in answers if a.status_code == 200]
    refused = [a for a in answers if a.status_code != 200]
    # the burst of 3, and what 0.2 requests a second refilled meanwhile
    assert 3 <= len(served) <= 3 + math.ceil(elapsed * 0.2)
    for answer in refused:
        error = _error(answer, 429, "rate_limit_exceeded")
        assert error["type"] == "rate_limit_error"
        assert "requests_per_second" in error["message"]
        assert 1 <= int(answer.headers["retry-after"]) <= 5  # 1 / 0.2 s at most
    assert tokenizations() - before == len(served)  # the refused did no work


def test_tokens_per_minute_are_charged_then_enforced(client: Any) -> None:
    first = client.post("/v1/embeddings", json={"input": LONG_TEXT}, headers=_auth("tokens"))
    assert first.status_code == 200, first.text  # admitted while not in debt
    charged = first.json()["usage"]["prompt_tokens"]
    assert charged > TOKENS_PER_MINUTE
    second = client.post("/v1/embeddings", json={"input": "a"}, headers=_auth("tokens"))
    error = _error(second, 429, "rate_limit_exceeded")
    assert "tokens_per_minute" in error["message"]
    # the debt, paid back at 12 tokens a minute
    debt_s = (charged - TOKENS_PER_MINUTE) * 60 / TOKENS_PER_MINUTE
    assert debt_s - 2 <= int(second.headers["retry-after"]) <= math.ceil(debt_s)
    metrics = client.get("/metrics").text
    assert _sample(metrics, 'poolserve_api_key_prompt_tokens_total{key="tokens"}') == charged
    series = 'poolserve_api_key_rejected_requests_total{key="tokens",reason="tokens_per_minute"}'
    assert _sample(metrics, series) == 1.0


def test_metrics_name_the_key_never_the_key_itself(client: Any) -> None:
    client.post("/v1/embeddings", json={"input": "a"}, headers=_auth("open"))
    metrics = client.get("/metrics", headers=_auth("hashed")).text
    assert _sample(metrics, 'poolserve_api_key_requests_total{key="open"}') >= 1
    assert _sample(metrics, 'poolserve_api_key_requests_total{key="default"}') >= 1
    for secret in SECRETS.values():
        assert secret not in metrics
        assert hashlib.sha256(secret.encode()).hexdigest() not in metrics


def test_the_access_log_names_the_key(client: Any, caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.INFO, logger="poolserve.access"):
        client.post("/v1/embeddings", json={"input": "a"}, headers=_auth("open"))
        client.post("/v1/embeddings", json={"input": "a"}, headers={"Authorization": "Bearer x"})
    served, refused = [r for r in caplog.records if r.name == "poolserve.access"][-2:]
    assert " key=open " in served.getMessage()
    assert getattr(served, FIELDS_ATTR)["key"] == "open"
    assert "key=" not in refused.getMessage()  # no key matched: no name to give
    assert SECRETS["open"] not in served.getMessage()


def test_a_reload_takes_new_keys_and_a_bad_file_keeps_them(
    client: Any, keys_file: Path, caplog: pytest.LogCaptureFixture
) -> None:
    keys = client.app.state.api_keys
    try:
        keys_file.write_text(KEYS_FILE.replace(SECRETS["open"], "sk-open-rotated"))
        client.portal.call(_on_loop, keys.reload)
        rotated = {"Authorization": "Bearer sk-open-rotated"}
        assert client.post("/v1/embeddings", json={"input": "a"}, headers=rotated).is_success
        old = client.post("/v1/embeddings", json={"input": "a"}, headers=_auth("open"))
        _error(old, 401, "invalid_api_key")
        keys_file.write_text("keys: [{name: open}]\n")
        with caplog.at_level(logging.INFO, logger="poolserve.http.tenants"):
            client.portal.call(_on_loop, keys.reload)
        said = [r.levelname for r in caplog.records if r.name == "poolserve.http.tenants"]
        assert said == ["ERROR"]
        assert client.post("/v1/embeddings", json={"input": "a"}, headers=rotated).is_success
    finally:
        keys_file.write_text(KEYS_FILE)
        client.portal.call(_on_loop, keys.reload)


async def _on_loop(work: Callable[[], None]) -> None:
    """Run `work` on the app's event loop, as the SIGHUP handler runs it."""
    work()


# ---- a real server with two front ends ----

LIVE = {"a": "sk-live-a-0123456789", "b": "sk-live-b-0123456789", "c": "sk-live-c-0123456789"}
LIVE_FILE = f"""
keys:
  - name: live-a
    key: {LIVE["a"]}
    requests_per_second: 1
    burst: 2
  - name: live-b
    key: sha256:{hashlib.sha256(LIVE["b"].encode()).hexdigest()}
"""


QUEUED = 'poolserve_queued_tokens{model_name="tiny"}'
LIVE_C = f"  - name: live-c\n    key: {LIVE['c']}\n"


class Live:
    """The server process, its URL, its keys file and its log."""

    def __init__(self, process: Any, url: str, keys: Path, log: Path) -> None:
        self.process, self.url, self.keys, self.log = process, url, keys, log

    def answers(self, secret: str, count: int = 12) -> set[int]:
        """The statuses of `count` requests, each on a connection of its own (the kernel
        spreads them over both front ends)."""
        body = {"input": "a"}
        headers = {"Authorization": f"Bearer {secret}", "Connection": "close"}
        url = f"{self.url}/v1/embeddings"
        return {
            httpx.post(url, json=body, headers=headers, timeout=30).status_code
            for _ in range(count)
        }

    def until(self, secret: str, status: int) -> None:
        """Wait for every front end to answer `secret` with `status`."""
        deadline = time.monotonic() + 20
        while self.answers(secret) != {status}:
            assert time.monotonic() < deadline, f"still not {status} for every front end"
            time.sleep(0.2)


@pytest.fixture(scope="module")
def live(
    tiny_model_dir: Callable[[str], Path], tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Live]:
    from tests.http.test_server_process import free_port, start_server

    folder = tmp_path_factory.mktemp("live-keys")
    keys, log = folder / "keys.yaml", folder / "server.log"
    keys.write_text(LIVE_FILE)
    port = free_port()
    args = [str(tiny_model_dir("llama")), "--served-model-name", "tiny"]
    args += ["--api-keys-file", str(keys), "--api-server-count", "2", "--max-model-len", "128"]
    process = start_server(port, *args, log=log)
    try:
        yield Live(process, f"http://127.0.0.1:{port}", keys, log)
    finally:
        process.send_signal(signal.SIGTERM)
        try:
            process.wait(timeout=30)
        except Exception:
            process.kill()


@pytest.mark.slow
def test_the_openai_client_gets_401_and_429_with_retry_after(live: Live) -> None:
    wrong = openai.OpenAI(base_url=f"{live.url}/v1", api_key="sk-wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError) as denied:
        wrong.embeddings.create(model="tiny", input="a")
    assert denied.value.status_code == 401
    client = openai.OpenAI(base_url=f"{live.url}/v1", api_key=LIVE["a"], max_retries=0)
    outcomes: list[Any] = []
    started = time.monotonic()

    def embed(_: int) -> None:
        try:
            outcomes.append(client.embeddings.create(model="tiny", input="a"))
        except openai.RateLimitError as exc:
            outcomes.append(exc)

    with ThreadPoolExecutor(8) as pool:
        list(pool.map(embed, range(10)))
    elapsed = time.monotonic() - started
    limited = [o for o in outcomes if isinstance(o, openai.RateLimitError)]
    served = len(outcomes) - len(limited)
    # a burst of 2 in all (1 per front end), then 1 a second in all
    assert 1 <= served <= 2 + math.ceil(elapsed)
    assert limited
    for refusal in limited:
        assert refusal.status_code == 429
        assert int(refusal.response.headers["retry-after"]) >= 1
        assert refusal.body["code"] == "rate_limit_exceeded"  # type: ignore[index]
    metrics = httpx.get(f"{live.url}/metrics").text  # both front ends' counts, summed
    assert _sample(metrics, 'poolserve_api_key_requests_total{key="live-a"}') == 10
    series = 'poolserve_api_key_rejected_requests_total{key="live-a",reason="requests_per_second"}'
    assert _sample(metrics, series) == len(limited)
    assert LIVE["a"] not in metrics


@pytest.mark.slow
def test_sighup_reloads_every_front_end_and_keeps_inflight_requests(live: Live) -> None:
    assert live.answers(LIVE["b"]) == {200}
    outcome: dict[str, Any] = {}

    def long_request() -> None:  # live-b's own, in flight while its key goes away
        body = {"input": [f"sentence {i} " * 30 for i in range(1000)]}
        headers = {"Authorization": f"Bearer {LIVE['b']}"}
        outcome["response"] = httpx.post(
            f"{live.url}/v1/embeddings", json=body, headers=headers, timeout=60
        )

    thread = threading.Thread(target=long_request)
    thread.start()
    deadline = time.monotonic() + 30
    while not _sample(httpx.get(f"{live.url}/metrics").text, QUEUED):  # in the engine now
        assert time.monotonic() < deadline and thread.is_alive(), "it never reached the engine"
        time.sleep(0.02)
    live.keys.write_text(LIVE_FILE.split("  - name: live-b")[0] + LIVE_C)
    assert thread.is_alive()  # the SIGHUP comes while the request runs
    live.process.send_signal(signal.SIGHUP)
    live.until(LIVE["c"], 200)
    assert live.answers(LIVE["b"]) == {401}
    thread.join(60)
    assert outcome["response"].status_code == 200
    assert len(outcome["response"].json()["data"]) == 1000
    assert live.process.poll() is None
    # a bad file: each front end says so in one line and keeps the keys it had
    live.keys.write_text("keys:\n  - name: live-a\n    requests_per_second: fast\n")
    live.process.send_signal(signal.SIGHUP)
    deadline = time.monotonic() + 20
    while len(_kept_lines(live.log)) < 2:
        assert time.monotonic() < deadline, live.log.read_text()[-2000:]
        time.sleep(0.1)
    assert len(_kept_lines(live.log)) == 2
    assert live.answers(LIVE["c"]) == {200}


def _kept_lines(log: Path) -> list[str]:
    return [
        line for line in log.read_text().splitlines() if "kept the 2 key(s) read before" in line
    ]
