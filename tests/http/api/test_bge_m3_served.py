"""bge-m3 served through the real app: dense on /v1/embeddings (and TEI's POST /), lexical
weights on /embed_sparse and /v1/pooling embed_sparse, ColBERT vectors on /v1/pooling
token_embed; each equal to FlagEmbedding's BGEM3 encode() (tests/tiny_m3.py)."""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import pytest
from starlette.testclient import TestClient

from poolserve.config.settings import ServerSettings
from poolserve.http.app import create_app
from tests.tiny_m3 import TEXTS, M3Reference, reference_encode, save_tiny_m3

NAME = "bge-m3"
TOLERANCE = 1e-5  # float32; tests/models/test_bge_m3.py measures the differences


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[TestClient, M3Reference]]:
    m3 = save_tiny_m3(tmp_path_factory.mktemp("bge-m3"))
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
