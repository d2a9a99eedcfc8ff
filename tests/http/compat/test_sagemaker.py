"""SageMaker's routes, as vLLM serves them: `POST /invocations` answers as the route whose body it
is (embeddings, classify, score, rerank, then pooling: the first the model serves), and
`GET|POST /ping` is the readiness probe, open without the API key. Each answer equals the native
route's for the same body (vLLM's tests compare them the same way)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
from starlette.testclient import TestClient

QUERY = "what is the capital of france"
DOCUMENTS = ["paris is the capital of france", "the cat sat on the mat"]


def _same_answer(client: TestClient, route: str, body: dict[str, Any]) -> dict[str, Any]:
    """The invocation's answer, checked equal to the native route's (ids and times aside)."""
    native = client.post(route, json=body)
    invoked = client.post("/invocations", json=body)
    assert native.status_code == invoked.status_code == 200, invoked.text
    first, second = native.json(), invoked.json()
    assert first.keys() == second.keys()
    for key in first.keys() - {"id", "created"}:
        assert first[key] == second[key], key
    return second


def test_an_embedding_model_answers_embeddings_score_and_rerank(
    make_client: Callable[..., Any],
) -> None:
    with make_client(None) as client:
        embedded = _same_answer(client, "/v1/embeddings", {"input": ["a text", "another"]})
        assert embedded["object"] == "list" and len(embedded["data"]) == 2
        scored = _same_answer(client, "/score", {"text_1": QUERY, "text_2": DOCUMENTS})
        assert len(scored["data"]) == 2
        ranked = _same_answer(client, "/rerank", {"query": QUERY, "documents": DOCUMENTS})
        assert len(ranked["results"]) == 2
        # a pooling body (its `task`) is no embeddings body: the pooling route answers it
        tokens = _same_answer(client, "/pooling", {"input": "a text", "task": "token_embed"})
        assert len(tokens["data"][0]["data"]) > 1
        refused = client.post("/invocations", json={"inputs": "TEI's body"})
        assert refused.status_code == 400
        assert refused.json()["error"]["message"] == (
            "Cannot find suitable handler for request. Expected one of: ['EmbeddingRequest', "
            "'ScoreRequest', 'RerankRequest', 'PoolingRequest']"
        )


def test_a_classifier_answers_classify(make_client: Callable[..., Any]) -> None:
    with make_client("llama_cls3") as client:
        classified = _same_answer(client, "/classify", {"input": ["good", "bad"]})
        assert len(classified["data"][0]["probs"]) == 3


def test_a_token_model_answers_pooling(make_client: Callable[..., Any]) -> None:
    with make_client("qwen2_prm") as client:
        _same_answer(
            client, "/pooling", {"input": "step one. step two.", "encoding_format": "float"}
        )


@pytest.mark.parametrize("method", ["GET", "POST"])
def test_ping_is_readiness_and_needs_no_key(make_client: Callable[..., Any], method: str) -> None:
    with make_client(None, api_key="secret") as client:
        assert client.request(method, "/ping").status_code == 200
        assert client.post("/invocations", json={"input": "a text"}).status_code == 401
