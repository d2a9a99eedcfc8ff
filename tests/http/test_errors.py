"""The bad-input contract: every row its own test, plus an auth matrix over all routes."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import pytest

from tests.http.serving import queue_taken

KEY = "s3cret-key"


@pytest.fixture(scope="module")
def client(make_client: Callable[..., Any]) -> Iterator[Any]:
    with make_client("llama", max_model_len=64, max_client_batch_size=4, payload_limit=4096) as c:
        yield c


def _error(response: Any, status: int, param: str | None = None) -> dict[str, Any]:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert "Traceback" not in error["message"]
    if param is not None:
        assert error["param"] == param, error
    return dict(error)


def test_malformed_json(client: Any) -> None:
    response = client.post(
        "/v1/embeddings", content=b"{not json", headers={"content-type": "application/json"}
    )
    _error(response, 400)


@pytest.mark.parametrize(
    "body,param",
    [
        ({"input": 5}, "input"),
        ({"input": ["a", 3]}, "input"),
        ({"input": "a", "dimensions": "ten"}, "dimensions"),
        ({"input": "a", "encoding_format": "hex"}, "encoding_format"),
    ],
)
def test_wrong_field_types_name_the_field(client: Any, body: dict[str, Any], param: str) -> None:
    _error(client.post("/v1/embeddings", json=body), 400, param)


def test_unknown_task(client: Any) -> None:
    _error(client.post("/v1/pooling", json={"input": "a", "task": "summarize"}), 400, "task")


@pytest.mark.parametrize("value", [[], "", ["ok", ""], [[]]])
def test_empty_input(client: Any, value: Any) -> None:
    _error(client.post("/v1/embeddings", json={"input": value}), 400, "input")


@pytest.mark.parametrize("ids", [[1, -2, 3], [1, 30522], [[5], [999999]]])
def test_token_ids_out_of_range(client: Any, ids: Any) -> None:
    _error(client.post("/v1/embeddings", json={"input": ids}), 400, "input")


@pytest.mark.parametrize("dimensions", [0, -3, 65, 16])
def test_invalid_or_unsupported_dimensions(client: Any, dimensions: int) -> None:
    # the tiny llama declares no Matryoshka support, so even 16 is refused
    _error(
        client.post("/v1/embeddings", json={"input": "a", "dimensions": dimensions}),
        400,
        "dimensions",
    )


def test_prompt_too_long_states_both_lengths(client: Any) -> None:
    error = _error(
        client.post("/v1/embeddings", json={"input": [list(range(1, 101))]}), 400, "input"
    )
    assert "100" in error["message"] and "64" in error["message"]


def test_truncation_makes_a_long_prompt_fit(client: Any) -> None:
    body = {"input": [list(range(1, 101))], "truncate_prompt_tokens": 64}
    response = client.post("/v1/embeddings", json=body)
    assert response.status_code == 200, response.text
    assert response.json()["usage"]["prompt_tokens"] == 64


def test_too_many_inputs(client: Any) -> None:
    _error(client.post("/v1/embeddings", json={"input": ["a"] * 5}), 400, "input")


def test_payload_too_large_declared(client: Any) -> None:
    error = _error(client.post("/v1/embeddings", json={"input": "a" * 5000}), 413)
    assert error["code"] == "payload_too_large"


def test_payload_too_large_streamed_without_length(client: Any) -> None:
    def chunks() -> Iterator[bytes]:
        yield b'{"input": "'
        for _ in range(10):
            yield b"a" * 1000
        yield b'"}'

    response = client.post(
        "/v1/embeddings", content=chunks(), headers={"content-type": "application/json"}
    )
    _error(response, 413)


def test_unsupported_task_lists_supported(client: Any) -> None:
    error = _error(client.post("/v1/pooling", json={"input": "a", "task": "classify"}), 400, "task")
    assert "embed" in error["message"] and "token_embed" in error["message"]


def test_unknown_model_is_404(client: Any) -> None:
    error = _error(
        client.post("/v1/embeddings", json={"input": "a", "model": "nope"}), 404, "model"
    )
    assert error["code"] == "model_not_found"


def _tokenizations(client: Any) -> float:
    for line in client.get("/metrics").text.splitlines():
        if line.startswith(
            'poolserve_tokenization_duration_seconds_count{lora_name="",model_name="llama"} '
        ):
            return float(line.split()[1])
    raise AssertionError("tokenization histogram not exported")


def test_admission_full_is_429_before_tokenization(make_client: Callable[..., Any]) -> None:
    with make_client("llama", max_num_queued_requests=2, max_client_batch_size=8) as client:
        response = client.post("/v1/embeddings", json={"input": ["a", "b", "c"]})
        assert response.status_code == 400  # more than the queue can ever hold: not an overload
        with queue_taken(client, 2, 10):  # the queue is full right now
            tokenized_before = _tokenizations(client)
            response = client.post("/v1/embeddings", json={"input": "a"})
            _error(response, 429)
            assert int(response.headers["retry-after"]) >= 1
            assert _tokenizations(client) == tokenized_before  # refused before any tokenization
            metrics = client.get("/metrics").text
            want = 'poolserve_rejected_requests_total{model_name="llama",reason="queue_full"} 1.0'
            assert want in metrics


def test_draining_is_503(make_client: Callable[..., Any]) -> None:
    with make_client("llama") as client:
        client.app.state.poolserve.draining = True
        _error(client.post("/v1/embeddings", json={"input": "a"}), 503)
        assert client.get("/ready").status_code == 503
        assert client.get("/health").status_code == 200
        client.app.state.poolserve.draining = False


INFERENCE_ROUTES = [
    ("POST", "/v1/embeddings", {"input": "a"}),
    ("POST", "/v1/pooling", {"input": "a"}),
    ("POST", "/pooling", {"input": "a"}),
    ("POST", "/v1/classify", {"input": "a"}),
    ("POST", "/classify", {"input": "a"}),
    ("POST", "/tokenize", {"prompt": "a"}),
    ("POST", "/detokenize", {"tokens": [1]}),
    ("GET", "/v1/models", None),
    ("GET", "/info", None),
    ("POST", "/v1/load_lora_adapter", {"lora_name": "a", "lora_path": "/nowhere"}),
    ("POST", "/v1/unload_lora_adapter", {"lora_name": "a"}),
]
OPEN_ROUTES = ["/health", "/ready", "/metrics"]


@pytest.fixture(scope="module")
def keyed(make_client: Callable[..., Any]) -> Iterator[Any]:
    with make_client("llama", api_key=KEY) as c:
        yield c


@pytest.mark.parametrize("method,path,body", INFERENCE_ROUTES)
@pytest.mark.parametrize("auth", [None, "Bearer wrong", f"Basic {KEY}", f"Bearer {KEY}"])
def test_auth_matrix(keyed: Any, method: str, path: str, body: Any, auth: str | None) -> None:
    headers = {"authorization": auth} if auth else {}
    response = keyed.request(method, path, json=body, headers=headers)
    if auth == f"Bearer {KEY}":
        assert response.status_code != 401
    else:
        assert _error(response, 401)["type"] == "authentication_error"


@pytest.mark.parametrize("path", OPEN_ROUTES)
def test_open_routes_need_no_key(keyed: Any, path: str) -> None:
    assert keyed.get(path).status_code == 200


def test_one_long_token_id_prompt_is_one_input(client: Any) -> None:
    """A flat token-id list is one prompt: its length is not counted as a batch size."""
    response = client.post("/v1/embeddings", json={"input": list(range(1, 41))})
    assert response.status_code == 200, response.text
    assert len(response.json()["data"]) == 1
