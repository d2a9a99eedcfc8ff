"""bge-m3 served through the real app: dense on /v1/embeddings (and TEI's POST /), lexical
weights on /embed_sparse and /v1/pooling embed_sparse, ColBERT vectors on /v1/pooling
token_embed; each equal to FlagEmbedding's BGEM3 encode() (tests/tiny_m3.py). With
weights_for_different_modes, /rerank and /score answer FlagEmbedding's compute_score."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import pytest
from starlette.testclient import TestClient

from poolserve.config.settings import ServerSettings
from poolserve.http.app import create_app
from tests.tiny_m3 import (
    TEXTS,
    M3Reference,
    TinyM3,
    reference_compute_score,
    reference_encode,
    save_tiny_m3,
)

NAME = "bge-m3"
TOLERANCE = 1e-5  # float32; tests/models/test_bge_m3.py measures the differences
# compute_score's float32 against the float64 comparison of the engine's float32 outputs,
# relative to the score's scale (the sparse score of these pairs reaches 267): 4e-7 measured
SCORE_TOLERANCE = 1e-5
FIELD = "weights_for_different_modes"
# each mode alone (FlagEmbedding's own weights order: dense, sparse, ColBERT), then mixes
WEIGHTS = ([1, 0, 0], [0, 1, 0], [0, 0, 1], [0.4, 0.2, 0.4], [1, 1, 1], [3, 0.5, 0])
MODES = {0: "dense", 1: "sparse", 2: "colbert"}


@pytest.fixture(scope="module")
def m3(tmp_path_factory: pytest.TempPathFactory) -> TinyM3:
    return save_tiny_m3(tmp_path_factory.mktemp("bge-m3"))


@pytest.fixture(scope="module")
def served(m3: TinyM3) -> Iterator[tuple[TestClient, M3Reference]]:
    settings = ServerSettings(model=str(m3.path), served_model_name=NAME, max_num_seqs=4)
    with TestClient(create_app(settings)) as client:
        yield client, reference_encode(m3, list(TEXTS))


def _close(got: object, want: np.ndarray) -> None:
    got = np.asarray(got, dtype=np.float32)
    assert got.shape == want.shape, (got.shape, want.shape)
    np.testing.assert_allclose(got, want, atol=TOLERANCE * max(1.0, float(np.abs(want).max())))


def test_embeddings_are_the_dense_vectors(served: tuple[TestClient, M3Reference]) -> None:
    client, reference = served
    response = client.post("/v1/embeddings", json={"model": NAME, "input": list(TEXTS)})
    assert response.status_code == 200, response.text
    _close([item["embedding"] for item in response.json()["data"]], reference.dense_vecs)
    # TEI's POST / answers the main output, dense (not sparse as for a SPLADE model)
    tei = client.post("/", json={"inputs": list(TEXTS)})
    assert tei.status_code == 200, tei.text
    _close(tei.json(), reference.dense_vecs)
    info = client.get("/info").json()
    assert info["model_type"] == {"embedding": {"pooling": "cls"}}
    assert {"embed", "embed_sparse", "token_embed"} <= set(info["tasks"])


def test_sparse_routes_are_the_lexical_weights(served: tuple[TestClient, M3Reference]) -> None:
    client, reference = served
    pooled = client.post("/v1/pooling", json={"input": list(TEXTS), "task": "embed_sparse"})
    assert pooled.status_code == 200, pooled.text
    tei = client.post("/embed_sparse", json={"inputs": list(TEXTS)})
    assert tei.status_code == 200, tei.text
    for item, entries, want in zip(
        pooled.json()["data"], tei.json(), reference.lexical_weights, strict=True
    ):
        indices, values = item["data"]["indices"], item["data"]["values"]
        assert [str(i) for i in indices] == sorted(want, key=int)
        _close(values, np.array([want[str(i)] for i in indices], dtype=np.float32))
        assert [e["index"] for e in entries] == indices
        assert [e["value"] for e in entries] == values


def test_token_embed_is_the_colbert_vectors(served: tuple[TestClient, M3Reference]) -> None:
    client, reference = served
    response = client.post("/v1/pooling", json={"input": list(TEXTS), "task": "token_embed"})
    assert response.status_code == 200, response.text
    for item, want in zip(response.json()["data"], reference.colbert_vecs, strict=True):
        _close(item["data"], want)


def test_rerank_by_dense_cosine(served: tuple[TestClient, M3Reference]) -> None:
    client, reference = served
    body = {"model": NAME, "query": TEXTS[0], "documents": list(TEXTS[1:3])}
    response = client.post("/rerank", json=body)
    assert response.status_code == 200, response.text
    scores = {r["index"]: r["relevance_score"] for r in response.json()["results"]}
    dense = reference.dense_vecs
    for index in (0, 1):
        assert abs(scores[index] - float(dense[0] @ dense[index + 1])) < 1e-5


def _rerank_scores(client: TestClient, route: str, body: dict[str, Any]) -> list[float]:
    response = client.post(route, json=body)
    assert response.status_code == 200, response.text
    by_index = {r["index"]: r["relevance_score"] for r in response.json()["results"]}
    return [by_index[i] for i in range(len(by_index))]


def _score_scores(client: TestClient, route: str, body: dict[str, Any]) -> list[float]:
    response = client.post(route, json=body)
    assert response.status_code == 200, response.text
    return [item["score"] for item in response.json()["data"]]


# route -> (the body of pairs, the scores of its answer, in pair order)
Pairs = list[tuple[str, str]]
ROUTES: dict[str, tuple[Callable[[Pairs], dict[str, Any]], Callable[..., list[float]]]] = {
    route: (
        lambda pairs: {"query": pairs[0][0], "documents": [d for _, d in pairs]},
        _rerank_scores,
    )
    for route in ("/rerank", "/v1/rerank", "/v2/rerank")
} | {
    route: (
        lambda pairs: {"queries": [q for q, _ in pairs], "documents": [d for _, d in pairs]},
        _score_scores,
    )
    for route in ("/score", "/v1/score")
}
# one query against every text (itself included), for the rerank routes
ONE_QUERY = [(TEXTS[1], text) for text in TEXTS]
# a query per document, for /score's N:N form
MANY_QUERIES = [*ONE_QUERY[:2], (TEXTS[2], TEXTS[1]), (TEXTS[4], TEXTS[5]), (TEXTS[3], TEXTS[0])]


def _assert_scores(got: list[float], want: list[float]) -> None:
    assert len(got) == len(want)
    for a, b in zip(got, want, strict=True):
        assert abs(a - b) <= SCORE_TOLERANCE * max(1.0, abs(b)), (got, want)


@pytest.mark.parametrize("route", list(ROUTES))
def test_weights_give_flag_embeddings_combined_score(
    served: tuple[TestClient, M3Reference], m3: TinyM3, route: str
) -> None:
    client, _ = served
    body_of, read = ROUTES[route]
    pairs = ONE_QUERY if "rerank" in route else MANY_QUERIES
    for weights in WEIGHTS:
        got = read(client, route, {**body_of(pairs), "model": NAME, FIELD: weights})
        want = reference_compute_score(m3, pairs, weights)
        _assert_scores(got, want["colbert+sparse+dense"])
        alone = [mode for i, mode in MODES.items() if weights[i] and sum(weights) == weights[i]]
        for mode in alone:  # one mode weighed alone is that mode's own score
            _assert_scores(got, want[mode])


def _prompt_tokens(client: TestClient) -> float:
    """The app's count of admitted prompt tokens (/metrics)."""
    lines = client.get("/metrics").text.splitlines()
    return sum(
        float(line.split()[-1])
        for line in lines
        if line.startswith("poolserve_prompt_tokens_total")
    )


def test_one_prompt_per_text_gives_all_three_modes(
    served: tuple[TestClient, M3Reference], m3: TinyM3
) -> None:
    # the three modes' outputs of a text come from one forward: the query and each document are
    # admitted once each, however many modes are weighed
    client, _ = served
    texts = [ONE_QUERY[0][0], *(d for _, d in ONE_QUERY)]
    before = _prompt_tokens(client)
    _rerank_scores(client, "/rerank", {**ROUTES["/rerank"][0](ONE_QUERY), FIELD: [1, 1, 1]})
    assert _prompt_tokens(client) - before == sum(len(m3.tokenizer(t)["input_ids"]) for t in texts)


def test_without_weights_the_score_is_still_the_dense_one(
    served: tuple[TestClient, M3Reference], m3: TinyM3
) -> None:
    client, _ = served
    got = _score_scores(client, "/score", ROUTES["/score"][0](MANY_QUERIES))
    _assert_scores(got, reference_compute_score(m3, MANY_QUERIES)["dense"])


@pytest.mark.parametrize(
    "weights",
    [[1, 0], [1, 0, 0, 0], [-0.5, 1, 1], [0, 0, 0], ["1", 0, 0], [True, 0, 0], [1e308] * 3, {}],
)
def test_weights_must_be_three_non_negative_numbers_with_a_positive_sum(
    served: tuple[TestClient, M3Reference], weights: object
) -> None:
    client, _ = served
    for route in ("/rerank", "/v2/rerank", "/score"):
        body = {"query": TEXTS[0], "documents": [TEXTS[1]], "queries": TEXTS[0], FIELD: weights}
        response = client.post(route, json=body)
        assert response.status_code == 400, (route, weights, response.text)
        assert response.json()["error"]["param"] == FIELD, response.text


@pytest.mark.parametrize("name", ["llama", "llama_cls1"])
def test_weights_on_another_model_are_refused(make_client: Any, name: str) -> None:
    # an embedder (dense cosine) and a cross-encoder: neither has bge-m3's other heads
    with make_client(name) as client:
        for route, body in (
            ("/rerank", {"query": "a", "documents": ["b", "c"]}),
            ("/score", {"queries": "a", "documents": ["b"]}),
        ):
            response = client.post(route, json={**body, FIELD: [1, 1, 1]})
            assert response.status_code == 400, response.text
            error = response.json()["error"]
            assert error["param"] == FIELD
            assert "no sparse and ColBERT heads" in error["message"]


def test_the_internal_task_is_not_offered(served: tuple[TestClient, M3Reference]) -> None:
    client, _ = served
    response = client.post("/v1/pooling", json={"input": "hello", "task": "embed_m3"})
    assert response.status_code == 400, response.text
    assert "embed_m3" not in client.get("/info").json()["tasks"]
    schema = client.get("/openapi.json").json()
    assert "embed_m3" not in str(schema["components"]["schemas"]["PoolingRequestBody"])


def test_other_rerank_bodies_refuse_the_weights(served: tuple[TestClient, M3Reference]) -> None:
    # TEI's and Infinity's bodies on /rerank do not honour it: refused, never the dense scores
    client, _ = served
    tei = {"query": TEXTS[0], "texts": [TEXTS[1]], FIELD: [1, 1, 1]}
    response = client.post("/rerank", json=tei)
    assert response.status_code == 422, response.text  # TEI's status and body for a bad field
    assert response.json()["error_type"] == "Validation" and FIELD in response.json()["error"]
    infinity = {"query": TEXTS[0], "documents": [TEXTS[1]], "raw_scores": False, FIELD: [1, 1, 1]}
    response = client.post("/rerank", json=infinity)
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == FIELD
