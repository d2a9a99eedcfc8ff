"""The HTTP edge: time and size bounds, duplicates refused, nothing leaked, errors well-formed."""

from __future__ import annotations

import json
import logging
import re
import socket
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from poolserve.http.api.inference import VOYAGE_PATHS
from poolserve.http.errors import MAX_MESSAGE_CHARS
from tests.http.test_server_process import free_port, start_server

KEY = "edge-key"
BODY_TIMEOUT_S = 1.0


# ---- in-process app ---------------------------------------------------------------------------
@pytest.fixture(scope="module")
def client(make_client: Callable[..., Any]) -> Iterator[Any]:
    with make_client("llama", api_key=KEY, max_model_len=64, payload_limit=1 << 20) as c:
        c.headers["authorization"] = f"Bearer {KEY}"
        yield c


def _error(response: Any, status: int, code: str | None = None) -> dict[str, Any]:
    assert response.status_code == status, response.text
    assert response.headers["content-type"] == "application/json"
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert all(isinstance(error[k], str) for k in ("message", "type", "code")), error
    if code is not None:
        assert error["code"] == code, error
    return dict(error)


@pytest.mark.parametrize(
    "values",
    [["Bearer wrong", f"Bearer {KEY}"], [f"Bearer {KEY}", "Bearer wrong"], [f"Bearer {KEY}"] * 2],
)
def test_two_authorization_headers_are_refused(client: Any, values: list[str]) -> None:
    headers = [("authorization", v) for v in values]
    response = client.post("/v1/embeddings", json={"input": "a"}, headers=headers)
    assert _error(response, 400, "duplicate_header")["param"] == "authorization"


@pytest.mark.parametrize(
    "body",
    [
        b'{"input": "a", "input": "b"}',
        b'{"input": "a", "dimensions": 8, "dimensions": null}',
        b'{"input": "a", "extra": {"k": 1, "k": 2}}',
    ],
)
def test_duplicate_json_keys_are_refused(client: Any, body: bytes) -> None:
    headers = {"content-type": "application/json"}
    response = client.post("/v1/embeddings", content=body, headers=headers)
    _error(response, 400, "duplicate_key")


def test_the_same_key_in_different_objects_is_fine(client: Any) -> None:
    body = b'{"input": "a", "model": "llama"}'
    headers = {"content-type": "application/json"}
    response = client.post("/v1/embeddings", content=body, headers=headers)
    assert response.status_code == 200, response.text


@pytest.mark.parametrize(
    "given,echoed",
    [("abc-123_X.y", True), ("a" * 128, True), ("a" * 129, False), ("bad id", False), ("é", False)],
)
def test_request_id_is_echoed_only_when_short_and_plain(
    client: Any, given: str, echoed: bool
) -> None:
    response = client.get("/health", headers={"x-request-id": given.encode()})
    got = response.headers["x-request-id"]
    if echoed:
        assert got == given
    else:
        assert re.fullmatch(r"[0-9a-f]{32}", got)


def test_every_response_says_nosniff(client: Any) -> None:
    responses = [
        client.get("/health"),
        client.post("/v1/embeddings", json={"input": "a"}),
        client.post("/v1/embeddings", json={"input": 5}),
        client.get("/nope"),
        client.get("/v1/embeddings"),
        client.post("/v1/embeddings", json={"input": "a"}, headers={"authorization": "no"}),
    ]
    for response in responses:
        assert response.headers["x-content-type-options"] == "nosniff", response.status_code


def test_no_absolute_paths_in_model_descriptions(
    client: Any, tiny_model_dir: Callable[[str], Path]
) -> None:
    for path in ("/info", "/v1/models"):
        text = client.get(path).text
        assert str(tiny_model_dir("llama")) not in text
        assert not re.search(r'"/[^"]*"', text), text
    assert client.get("/v1/models").json()["data"][0]["root"] == tiny_model_dir("llama").name


@pytest.mark.parametrize(
    "method,path,allow", [("GET", "/v1/embeddings", "POST"), ("POST", "/health", "GET")]
)
def test_405_names_the_allowed_methods(client: Any, method: str, path: str, allow: str) -> None:
    response = client.request(method, path)
    _error(response, 405, "method_not_allowed")
    assert response.headers["allow"] == allow


MALFORMED: list[tuple[dict[str, str], bytes]] = [
    ({"content-type": "application/json"}, b"{not json"),
    ({"content-type": "application/json"}, b""),
    ({"content-type": "application/json"}, b"[1, 2]"),
    ({"content-type": "application/json"}, b"null"),
    ({"content-type": "application/json"}, b'"input"'),
    ({"content-type": "application/json"}, b'{"input": "\xff"}'),
    ({"content-type": "application/json"}, b'{"input": "a"} trailing'),
    ({"content-type": "text/plain"}, b'{"input": "a"}'),
    ({"content-type": "application/x-www-form-urlencoded"}, b"input=a"),
    ({}, b'{"input": "a"}'),
    ({"content-type": "application/json"}, b'{"input": ' + b"[" * 5000 + b"]" * 5000 + b"}"),
]


@pytest.mark.parametrize("headers,body", MALFORMED)
@pytest.mark.parametrize("path", ["/v1/embeddings", "/v1/pooling", "/tokenize", "/detokenize"])
def test_malformed_bodies_get_a_code(
    client: Any, path: str, headers: dict[str, str], body: bytes
) -> None:
    response = client.post(path, content=body, headers=headers)
    assert 400 <= response.status_code < 500, response.text
    _error(response, response.status_code)


def test_echoed_client_text_is_bounded(client: Any, caplog: pytest.LogCaptureFixture) -> None:
    long_name = "f" * 100_000
    # an unknown field is accepted (as vLLM does); the warning naming it is clipped
    with caplog.at_level(logging.WARNING, logger="poolserve.http.bodies"):
        assert client.post("/v1/embeddings", json={"input": "a", long_name: 1}).status_code == 200
    assert caplog.records and all(len(r.getMessage()) < 1000 for r in caplog.records)
    error = _error(client.post("/v1/embeddings", json={"input": "a", "messages": 1}), 400)
    assert len(error["message"]) <= MAX_MESSAGE_CHARS + 3
    error = _error(client.post("/v1/embeddings", json={"input": "a", "model": long_name}), 404)
    assert len(error["message"]) <= MAX_MESSAGE_CHARS + 3


TEI_ONLY = {
    "/embed",
    "/embed_all",
    "/embed_sparse",
    "/similarity",
    "/predict",
    "/decode",
    "/",
    "/vertex",  # Vertex AI's route, as TEI serves it
}
SHARED_WITH_TEI = {"/rerank", "/tokenize"}


def test_openapi_documents_400_and_never_422_but_on_tei_paths(client: Any) -> None:
    schema = client.get("/openapi.json").json()
    assert "ErrorBody" in schema["components"]["schemas"]
    assert schema["components"]["schemas"]["TEIErrorBody"]["required"] == ["error", "error_type"]
    openai = {"$ref": "#/components/schemas/ErrorBody"}
    either = {"anyOf": [openai, {"$ref": "#/components/schemas/TEIErrorBody"}]}
    ollama = {"anyOf": [openai, {"$ref": "#/components/schemas/OllamaErrorBody"}]}
    voyage = {"anyOf": [openai, {"$ref": "#/components/schemas/VoyageErrorBody"}]}
    for path, item in schema["paths"].items():
        for method, operation in item.items():
            responses = operation["responses"]
            tei = path in TEI_ONLY | SHARED_WITH_TEI
            # TEI answers 422 for a body off its schema; nothing else ever does
            assert ("422" in responses) == (tei and "requestBody" in operation), (path, method)
            if "requestBody" in operation:
                for status in ("400", "401", "408", "413", "503"):
                    content = responses[status]["content"]["application/json"]["schema"]
                    expected = either if tei else ollama if path.startswith("/api/") else openai
                    expected = voyage if path in VOYAGE_PATHS else expected
                    assert content == expected, (path, method, status)
    streamed = schema["paths"]["/v1/pooling"]["post"]["responses"]["200"]["content"]
    assert "application/x-ndjson" in streamed


def test_draining_answers_close_the_connection(make_client: Callable[..., Any]) -> None:
    with make_client("llama") as c:
        c.app.state.poolserve.draining = True
        assert c.get("/health").headers["connection"] == "close"
        c.app.state.poolserve.draining = False


# ---- a real server: what uvicorn and the HTTP parser do ----------------------------------------
@pytest.fixture(scope="module")
def server(tiny_model_dir: Callable[[str], Path]) -> Iterator[int]:
    port = free_port()
    process = start_server(
        port, "--model", str(tiny_model_dir("llama")), "--body-timeout", str(BODY_TIMEOUT_S)
    )
    try:
        yield port
    finally:
        process.kill()
        process.wait(10)


def _exchange(port: int, data: bytes, timeout_s: float = 10) -> tuple[bytes, float]:
    """Send data, then read until the server closes; (everything read, seconds it took)."""
    started = time.monotonic()
    with socket.create_connection(("127.0.0.1", port), timeout=timeout_s) as sock:
        sock.sendall(data)
        return _read_to_close(sock), time.monotonic() - started


def _read_to_close(sock: socket.socket) -> bytes:
    chunks = []
    while chunk := sock.recv(65536):
        chunks.append(chunk)
    return b"".join(chunks)


def _parse(raw: bytes) -> tuple[int, dict[str, str], dict[str, Any]]:
    head, _, body = raw.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    headers = dict(line.lower().split(": ", 1) for line in lines[1:])
    return int(lines[0].split()[1]), headers, json.loads(body)


def _check_refusal(raw: bytes, status: int, code: str) -> None:
    got, headers, body = _parse(raw)
    assert got == status, raw[:300]
    assert body["error"]["code"] == code
    assert headers["connection"] == "close"
    assert headers["x-content-type-options"] == "nosniff"
    assert "server" not in headers


@pytest.mark.slow
def test_a_body_that_stops_gets_408_and_the_connection_closes(server: int) -> None:
    head = (
        b"POST /v1/embeddings HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
        b"content-length: 100\r\n\r\n"
    )
    raw, elapsed = _exchange(server, head + b'{"input": ')
    _check_refusal(raw, 408, "body_timeout")
    assert BODY_TIMEOUT_S * 0.9 <= elapsed <= BODY_TIMEOUT_S + 2


@pytest.mark.slow
def test_headers_that_stop_get_408_and_silence_is_closed(server: int) -> None:
    raw, elapsed = _exchange(server, b"POST /v1/embeddings HTTP/1.1\r\nhost: x\r\n")
    _check_refusal(raw, 408, "head_timeout")
    assert elapsed <= BODY_TIMEOUT_S + 2
    raw, elapsed = _exchange(server, b"")
    assert raw == b"" and elapsed <= BODY_TIMEOUT_S + 2


@pytest.mark.slow
def test_a_thousand_stalled_uploads_cost_nothing(server: int) -> None:
    head = (
        b"POST /v1/embeddings HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
        b"content-length: 1000\r\n\r\n"
    )
    sockets = []
    try:
        for _ in range(1000):
            sock = socket.create_connection(("127.0.0.1", server), timeout=10)
            sock.sendall(head)
            sockets.append(sock)
        started = time.monotonic()
        assert httpx.get(f"http://127.0.0.1:{server}/health", timeout=5).status_code == 200
        for sock in sockets:
            status, _, _ = _parse(_read_to_close(sock))
            assert status == 408
        # every one answered and closed by the timeout, none held open
        assert time.monotonic() - started <= BODY_TIMEOUT_S + 5
    finally:
        for sock in sockets:
            sock.close()


@pytest.mark.slow
def test_oversized_headers_get_431(server: int) -> None:
    big = b"GET /health HTTP/1.1\r\nhost: x\r\nx-big: " + b"a" * 100_000 + b"\r\n\r\n"
    raw, _ = _exchange(server, big)
    _check_refusal(raw, 431, "headers_too_large")
    fine = b"GET /health HTTP/1.1\r\nhost: x\r\nx-big: " + b"a" * 16_000 + b"\r\n\r\n"
    with socket.create_connection(("127.0.0.1", server), timeout=10) as sock:
        sock.sendall(fine)
        assert sock.recv(65536).startswith(b"HTTP/1.1 200")


@pytest.mark.slow
def test_garbage_gets_a_json_400(server: int) -> None:
    raw, _ = _exchange(server, b"NOT HTTP AT ALL\r\n\r\n")
    _check_refusal(raw, 400, "invalid_http")


@pytest.mark.slow
def test_no_server_header(server: int) -> None:
    response = httpx.get(f"http://127.0.0.1:{server}/health")
    assert "server" not in response.headers
    assert response.headers["x-content-type-options"] == "nosniff"


def test_served_name_of_a_local_directory_is_its_folder_name(tmp_path: Path) -> None:
    from poolserve.config.models_file import default_name as _default_name

    model_dir = tmp_path / "my-embedder"
    model_dir.mkdir()
    assert _default_name(str(model_dir)) == "my-embedder"
    assert _default_name(str(model_dir) + "/") == "my-embedder"
    assert _default_name("org/hub-model") == "org/hub-model"
    assert str(tmp_path) not in _default_name(str(model_dir))
