"""Infinity's `/embeddings`, `/models` and `/rerank` bodies through the app."""

from __future__ import annotations

import base64
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import pytest
import torch
from sentence_transformers import CrossEncoder
from starlette.testclient import TestClient

from poolserve.config.settings import ServerSettings
from poolserve.http.app import create_app
from poolserve.http.compat.infinity import UNNAMED_MODEL
from tests.tiny_rerankers import save_cross_encoder

TEXTS = ["hello world", "the cat sat on the mat", "poolserve serves pooled outputs"]
QUERY = "where does the cat sit"


@pytest.fixture(scope="module")
def client(make_client: Callable[..., Any]) -> Iterator[Any]:
    with make_client(None) as started:
        yield started


def _post(client: Any, path: str, body: dict[str, Any]) -> dict[str, Any]:
    response = client.post(path, json=body)
    assert response.status_code == 200, response.text
    answer: dict[str, Any] = response.json()
    return answer


def test_embeddings_equal_the_openai_route_in_infinitys_shape(client: Any) -> None:
    own = _post(client, "/v1/embeddings", {"input": TEXTS})
    body = {"input": TEXTS, "model": UNNAMED_MODEL, "modality": "text", "dimensions": 0}
    answer = _post(client, "/embeddings", body)
    assert answer["object"] == "list" and answer["model"] == own["model"]
    tokens = own["usage"]["prompt_tokens"]
    assert answer["usage"] == {"prompt_tokens": tokens, "total_tokens": tokens}
    assert answer["id"].startswith("infinity-") and isinstance(answer["created"], int)
    assert [d["index"] for d in answer["data"]] == [0, 1, 2]
    assert {d["object"] for d in answer["data"]} == {"embedding"}
    assert [d["embedding"] for d in answer["data"]] == [d["embedding"] for d in own["data"]]
    encoded = _post(client, "/embeddings", {"input": TEXTS, "encoding_format": "base64"})
    for item, want in zip(encoded["data"], own["data"], strict=True):
        got = np.frombuffer(base64.b64decode(item["embedding"]), dtype="<f4")
        assert np.array_equal(got, np.asarray(want["embedding"], dtype=np.float32))


def test_texts_are_stripped_as_infinity_strips_them(client: Any) -> None:
    padded = _post(client, "/embeddings", {"input": "  the cat sat on the mat \n"})
    plain = _post(client, "/embeddings", {"input": "the cat sat on the mat"})
    assert padded["data"][0]["embedding"] == plain["data"][0]["embedding"]


@pytest.mark.parametrize(
    ("body", "status", "param"),
    [
        ({"input": ["http://x/cat.png"], "modality": "image"}, 400, "modality"),
        ({"input": ["http://x/beep.wav"], "modality": "audio"}, 400, "modality"),
        ({"input": []}, 400, "input"),
        ({"input": TEXTS, "encoding_format": "int8"}, 400, "encoding_format"),
        ({"input": TEXTS, "dimensions": 385}, 400, "dimensions"),
    ],
)
def test_embeddings_refusals(client: Any, body: dict[str, Any], status: int, param: str) -> None:
    response = client.post("/embeddings", json=body)
    assert response.status_code == status, response.text
    assert response.json()["error"]["param"] == param


def test_models_in_infinitys_shape(client: Any) -> None:
    response = client.get("/models")
    assert response.status_code == 200, response.text
    answer = response.json()
    assert answer["object"] == "list" and len(answer["data"]) == 1
    card = answer["data"][0]
    served = client.get("/v1/models").json()["data"][0]["id"]
    assert card["id"] == served and card["object"] == "model" and card["owned_by"] == "infinity"
    assert set(card["stats"]) == {
        "queue_fraction",
        "queue_absolute",
        "results_pending",
        "batch_size",
    }
    assert "embed" in card["capabilities"] and isinstance(card["created"], int)


def test_rerank_with_infinitys_body(client: Any) -> None:
    vllm = _post(client, "/rerank", {"query": QUERY, "documents": TEXTS})
    body = {
        "query": QUERY,
        "documents": TEXTS,
        "return_documents": False,
        "raw_scores": False,
        "model": UNNAMED_MODEL,
    }
    answer = _post(client, "/rerank", body)
    assert answer["object"] == "rerank" and answer["model"] == vllm["model"]
    assert answer["id"].startswith("infinity-") and isinstance(answer["created"], int)
    tokens = answer["usage"]["prompt_tokens"]
    assert tokens > 0 and answer["usage"] == {"prompt_tokens": tokens, "total_tokens": tokens}
    assert [(r["index"], r["relevance_score"]) for r in answer["results"]] == [
        (r["index"], r["relevance_score"]) for r in vllm["results"]
    ]
    assert all(r["document"] is None for r in answer["results"])
    top = _post(client, "/rerank", {**body, "return_documents": True, "top_n": 1})["results"]
    best = vllm["results"][0]["index"]
    score = vllm["results"][0]["relevance_score"]
    assert top == [{"relevance_score": score, "index": best, "document": TEXTS[best]}]


def test_rerank_refuses_a_bad_infinity_body(client: Any) -> None:
    body = {"query": QUERY, "documents": TEXTS, "raw_scores": False, "top_n": 0}
    response = client.post("/rerank", json=body)
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == "top_n"


def test_rerank_raw_scores_on_a_cross_encoder(tmp_path_factory: pytest.TempPathFactory) -> None:
    directory = save_cross_encoder("bert_cls", tmp_path_factory.mktemp("bert_ce"))
    logits = CrossEncoder(str(directory), device="cpu").predict(
        [(QUERY, d) for d in TEXTS], activation_fn=torch.nn.Identity()
    )
    settings = ServerSettings(model=str(directory), served_model_name="ce")
    body = {"query": QUERY, "documents": TEXTS, "model": "ce"}
    with TestClient(create_app(settings)) as ce:
        raw = _post(ce, "/rerank", {**body, "raw_scores": True})["results"]
        scored = _post(ce, "/rerank", {**body, "raw_scores": False})["results"]
    by_index = {r["index"]: r["relevance_score"] for r in raw}
    assert np.allclose([by_index[i] for i in range(len(TEXTS))], logits, atol=1e-4)
    assert [r["index"] for r in raw] == list(np.argsort(-logits, kind="stable"))
    sigmoid = {r["index"]: r["relevance_score"] for r in scored}
    assert np.allclose(
        [sigmoid[i] for i in range(len(TEXTS))], 1 / (1 + np.exp(-logits)), atol=1e-5
    )
