"""Sparse embeddings over HTTP: /v1/pooling with task embed_sparse, and TEI's /embed_sparse."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import numpy as np
import orjson
import pytest
import torch
from starlette.testclient import TestClient

from poolserve.config.settings import ServerSettings
from poolserve.http.app import create_app
from tests.http.serving import assert_close
from tests.tiny_encoders import build_hf_encoder, encoder_dirs
from tests.tiny_models import SPECIAL_TOKENS, VOCAB_SIZE

TEXTS = ["hello world", "sparse lexical weights for retrieval " * 3, "x"]
MODEL = "bert_mlm"
# what sparse pooling skips: the tokenizer's specials except UNK
SKIPPED = frozenset(SPECIAL_TOKENS.values()) - {SPECIAL_TOKENS["[UNK]"]}


@pytest.fixture(scope="module")
def serve(tmp_path_factory: pytest.TempPathFactory) -> Callable[..., Any]:
    """serve(name, **settings) -> context manager yielding a started TestClient."""
    directory = encoder_dirs(tmp_path_factory)

    @contextmanager
    def make(name: str, **settings: Any) -> Iterator[TestClient]:
        config = ServerSettings(model=str(directory(name)), served_model_name=name, **settings)
        with TestClient(create_app(config)) as client:
            yield client

    return make


@pytest.fixture(scope="module")
def client(serve: Callable[..., Any]) -> Iterator[TestClient]:
    """A server over the tiny BERT MLM, with a short max_model_len to exercise truncation."""
    with serve(MODEL, max_model_len=24) as started:
        yield started


def _ids(client: TestClient, text: str) -> list[int]:
    return list(client.post("/tokenize", json={"prompt": text}).json()["tokens"])


def _reference(ids: list[int]) -> np.ndarray:
    """transformers' MLM logits -> log1p(relu) -> max over non-special tokens, dense."""
    with torch.no_grad():
        logits = build_hf_encoder(MODEL)(input_ids=torch.tensor([ids])).logits[0]
    kept = [i for i, token in enumerate(ids) if token not in SKIPPED]
    return torch.log1p(torch.relu(logits[kept])).amax(dim=0).numpy()


def _dense(indices: list[int], values: list[float], size: int) -> np.ndarray:
    assert indices == sorted(set(indices)) and all(v > 0 for v in values)
    dense = np.zeros(size, dtype=np.float32)
    dense[indices] = values
    return dense


def test_pooling_embed_sparse_shape_and_values(client: TestClient) -> None:
    response = client.post("/v1/pooling", json={"input": TEXTS[:2], "task": "embed_sparse"})
    assert response.status_code == 200, response.text
    body = response.json()
    assert set(body) == {"id", "object", "created", "model", "data", "usage"}
    assert body["id"].startswith("pool-") and body["object"] == "list"
    assert body["model"] == MODEL and isinstance(body["created"], int)
    ids = [_ids(client, text) for text in TEXTS[:2]]
    tokens = sum(len(p) for p in ids)
    assert body["usage"] == {  # vLLM's UsageInfo
        "prompt_tokens": tokens,
        "total_tokens": tokens,
        "completion_tokens": 0,
        "prompt_tokens_details": None,
        "completion_tokens_details": None,
    }
    for index, (prompt, item) in enumerate(zip(ids, body["data"], strict=True)):
        assert item["index"] == index and item["object"] == "pooling"
        assert set(item["data"]) == {"indices", "values"}
        indices, values = item["data"]["indices"], item["data"]["values"]
        assert len(indices) == len(values) > 0
        assert all(isinstance(i, int) for i in indices)
        want = _reference(prompt)
        assert_close(_dense(indices, values, want.shape[0]), want)


def test_streamed_sparse_lines_equal_the_plain_response(client: TestClient) -> None:
    plain = client.post("/v1/pooling", json={"input": TEXTS, "task": "embed_sparse"}).json()
    request = {"input": TEXTS, "task": "embed_sparse", "stream": True}
    with client.stream("POST", "/v1/pooling", json=request) as response:
        assert response.status_code == 200
        lines = [orjson.loads(line) for line in response.iter_lines() if line]
    *items, usage = lines
    assert usage["object"] == "usage" and usage["usage"] == plain["usage"]
    assert sorted(items, key=lambda item: item["index"]) == plain["data"]


def test_base64_does_not_apply_to_embed_sparse(client: TestClient) -> None:
    request = {"input": "a", "task": "embed_sparse", "encoding_format": "base64"}
    response = client.post("/v1/pooling", json=request)
    assert response.status_code == 400
    assert response.json()["error"]["param"] == "encoding_format"


def test_tei_embed_sparse_equals_pooling(client: TestClient) -> None:
    pooled = client.post("/v1/pooling", json={"input": TEXTS, "task": "embed_sparse"}).json()
    response = client.post("/embed_sparse", json={"inputs": TEXTS})
    assert response.status_code == 200, response.text
    assert response.headers["content-type"] == "application/json"
    body = response.json()
    assert isinstance(body, list) and len(body) == len(TEXTS)
    for entries, item in zip(body, pooled["data"], strict=True):
        assert all(set(entry) == {"index", "value"} for entry in entries)
        assert [e["index"] for e in entries] == item["data"]["indices"]
        assert [e["value"] for e in entries] == item["data"]["values"]
    (single,) = client.post("/embed_sparse", json={"inputs": TEXTS[0]}).json()
    # alone or batched: the same weights within float tolerance
    assert_close(_dense_entries(single), _dense_entries(body[0]))


def _dense_entries(entries: list[dict[str, Any]]) -> np.ndarray:
    indices, values = [e["index"] for e in entries], [e["value"] for e in entries]
    return _dense(indices, values, VOCAB_SIZE)


@pytest.mark.parametrize("direction", ["right", "left", "Left"])
def test_tei_truncate_and_direction(client: TestClient, direction: str) -> None:
    long_text = " ".join(f"term{i}" for i in range(40))  # far above max_model_len 24
    # only `truncate: false` refuses (TEI's 422 Validation); unset truncates, as TEI >= 1.9
    refused = client.post("/embed_sparse", json={"inputs": long_text, "truncate": False})
    assert refused.status_code == 422
    assert refused.json()["error_type"] == "Validation"
    request = {"inputs": [long_text], "truncate": True, "truncation_direction": direction}
    response = client.post("/embed_sparse", json=request)
    assert response.status_code == 200, response.text
    unset = {"inputs": [long_text], "truncation_direction": direction}
    assert client.post("/embed_sparse", json=unset).json() == response.json()
    side = direction.lower()
    same = client.post(
        "/v1/pooling",
        json={
            "input": [long_text],
            "task": "embed_sparse",
            "truncate_prompt_tokens": -1,
            "truncation_side": side,
        },
    ).json()
    assert [e["index"] for e in response.json()[0]] == same["data"][0]["data"]["indices"]
    assert same["usage"]["prompt_tokens"] == 24


def test_tei_prompt_name_and_unknown_fields(client: TestClient) -> None:
    # this model has no sentence-transformers prompts: any prompt_name is unknown
    response = client.post("/embed_sparse", json={"inputs": "a", "prompt_name": "query"})
    assert response.status_code == 422 and response.json()["error_type"] == "Validation"
    assert "prompt_name" in response.json()["error"]
    # fields TEI does not define are ignored, as TEI's serde bodies ignore them
    plain = client.post("/embed_sparse", json={"inputs": "a"}).json()
    assert client.post("/embed_sparse", json={"inputs": "a", "normalize": True}).json() == plain


def test_model_without_mlm_head_names_its_tasks(serve: Callable[..., Any]) -> None:
    with serve("bert") as plain:
        pooled = plain.post("/v1/pooling", json={"input": "a", "task": "embed_sparse"})
        tei = plain.post("/embed_sparse", json={"inputs": "a"})
        tasks = plain.get("/info").json()["tasks"]
    assert "embed_sparse" not in tasks
    assert pooled.status_code == 400
    error = pooled.json()["error"]
    assert error["code"] == "unsupported_task"
    assert "embed, token_embed" in error["message"]
    # TEI's answer for a model that is not SPLADE: 424 Backend
    assert tei.status_code == 424 and tei.json()["error_type"] == "Backend"
    assert "embed, token_embed" in tei.json()["error"]


def test_embed_sparse_needs_the_api_key(serve: Callable[..., Any]) -> None:
    with serve(MODEL, api_key="secret") as keyed:
        assert keyed.post("/embed_sparse", json={"inputs": "a"}).status_code == 401
        headers = {"Authorization": "Bearer secret"}
        response = keyed.post("/embed_sparse", json={"inputs": "a"}, headers=headers)
        assert response.status_code == 200
        assert "embed_sparse" in keyed.get("/info", headers=headers).json()["tasks"]
