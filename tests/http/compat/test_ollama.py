"""Ollama's embedding API, replayed by Ollama's own Python client and langchain-ollama against a
real server, and its rules checked on the app: /api/embed normalizes every embedding and cuts
`dimensions` then normalizes again, cuts at the model's length unless `truncate` is false, "" is
no input; /api/embeddings answers the model's own embedding; errors are `{"error": message}`."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import httpx
import numpy as np
import pytest

TEXTS = ["the cat sat on the mat", "a dog barked at the mailman"]


def _reference(client: Any, texts: list[str]) -> np.ndarray:
    """The server's OpenAI embeddings of the texts (held to sentence-transformers elsewhere)."""
    answer = client.post("/v1/embeddings", json={"input": texts})
    return np.array([item["embedding"] for item in answer.json()["data"]])


def _name(client: Any) -> str:
    """The served name of the app's model."""
    name: str = client.get("/v1/models").json()["data"][0]["id"]
    return name


def test_embed_normalizes_and_cuts(make_client: Callable[..., Any]) -> None:
    with make_client(None) as client:
        minilm = _name(client)
        full = _reference(client, TEXTS)
        answer = client.post("/api/embed", json={"model": f"{minilm}:latest", "input": TEXTS})
        assert answer.status_code == 200, answer.text
        document = answer.json()
        assert document["model"] == f"{minilm}:latest"
        assert document["prompt_eval_count"] > 0 and document["total_duration"] > 0
        vectors = np.array(document["embeddings"])
        assert np.allclose(vectors, full / np.linalg.norm(full, axis=1, keepdims=True), atol=1e-6)
        cut = client.post("/api/embed", json={"model": minilm, "input": TEXTS, "dimensions": 8})
        expected = full[:, :8] / np.linalg.norm(full[:, :8], axis=1, keepdims=True)
        assert np.allclose(np.array(cut.json()["embeddings"]), expected, atol=1e-6)
        empty = client.post("/api/embed", json={"model": minilm, "input": ""})
        assert empty.json() == {"model": minilm, "embeddings": []}
        legacy = client.post("/api/embeddings", json={"model": minilm, "prompt": TEXTS[0]})
        assert np.allclose(np.array(legacy.json()["embedding"]), full[0], atol=1e-6)


def test_truncation_and_errors(make_client: Callable[..., Any]) -> None:
    long_text = "word " * 2000
    with make_client(None) as client:
        minilm = _name(client)
        cut = client.post("/api/embed", json={"model": minilm, "input": long_text})
        assert cut.status_code == 200 and len(cut.json()["embeddings"][0]) == 384
        body = {"model": minilm, "input": long_text, "truncate": False}
        refused = client.post("/api/embed", json=body)
        assert refused.status_code == 400 and list(refused.json()) == ["error"]
        missing = client.post("/api/embed", json={"model": "nomic-embed-text", "input": "a"})
        assert missing.status_code == 404
        assert missing.json() == {"error": "model 'nomic-embed-text' not found"}
        # a lone surrogate is valid JSON: the name is echoed escaped, never a 500
        for path in ("/api/embed", "/v1/embeddings"):
            odd = client.post(
                path,
                content=b'{"model": "\\ud800x", "input": "a"}',
                headers={"content-type": "application/json"},
            )
            assert odd.status_code == 404 and "\\ud800x" in odd.text, odd.text
        invalid = client.post("/api/embed", json={"model": minilm, "input": [1, 2]})
        assert invalid.status_code == 400 and list(invalid.json()) == ["error"]


def test_ollama_clients_against_a_live_server(live_minilm: httpx.Client) -> None:
    ollama = pytest.importorskip("ollama")
    from langchain_ollama import OllamaEmbeddings

    host = str(live_minilm.base_url).rstrip("/")
    reference = np.array(
        [
            d["embedding"]
            for d in live_minilm.post(
                "/v1/embeddings", json={"model": "minilm", "input": TEXTS}
            ).json()["data"]
        ]
    )
    client = ollama.Client(host=host)
    embedded = client.embed(model="minilm", input=TEXTS)
    assert np.allclose(np.array(embedded.embeddings), reference, atol=1e-6)
    legacy = client.embeddings(model="minilm", prompt=TEXTS[0])
    assert np.allclose(np.array(legacy.embedding), reference[0], atol=1e-6)
    names = [m.model for m in client.list().models]
    assert "minilm" in names
    assert "embedding" in (client.show("minilm").capabilities or [])
    with pytest.raises(ollama.ResponseError) as refused:
        client.embed(model="nomic-embed-text", input="a")
    assert refused.value.status_code == 404
    langchain = OllamaEmbeddings(model="minilm", base_url=host)
    assert np.allclose(np.array(langchain.embed_documents(TEXTS)), reference, atol=1e-6)
    assert np.allclose(np.array(langchain.embed_query(TEXTS[0])), reference[0], atol=1e-6)
