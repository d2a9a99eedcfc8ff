"""vLLM 0.33's Cohere `/v2/embed` HTTP tests, ported.

The same requests and assertions as vLLM's tests/entrypoints/pooling/embed/test_cohere_online.py
(read at vllm-project/vllm 00d8e27) and embed/test_cohere_openai_parity.py (41c5903). vLLM runs
them on multilingual-e5-small, snowflake-arctic-embed-m-v1.5 (declared Matryoshka, which none
of the cases uses) and bge-base-en-v1.5; here on the bundled all-MiniLM-L6-v2 (sentence-
transformers, mean pooling, normalized, no prompts, as those three are served without an
input_type), its floats checked against sentence-transformers as well. vLLM's
test_cohere_online_vision.py needs image inputs (none here); its test_cohere_protocol.py and
embed/cohere/test_protocol.py test its request classes, not the route.

Where this server answers differently on purpose, the case asserts this server's answer and
says why (docs/api.md lists each difference).
"""

from __future__ import annotations

import base64
import struct
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
from sentence_transformers import SentenceTransformer

from tests.http.api.vllm_checks import cosine
from tests.http.serving import LiveServers, assert_close

MODEL = "minilm"
LONG_TEXT = " ".join(["word"] * 2000)


@pytest.fixture(scope="module")
def server(live_servers: LiveServers) -> httpx.Client:
    # vLLM: --runner pooling --dtype bfloat16 --max-model-len 512
    return live_servers.serve(None, MODEL, max_model_len=512)


@pytest.fixture(scope="module")
def st(minilm_dir: Path) -> SentenceTransformer:
    return SentenceTransformer(str(minilm_dir), device="cpu")


def _cohere_embed(server: Any, **body: Any) -> dict[str, Any]:
    response = server.post("/v2/embed", json={"model": MODEL, **body})
    assert response.status_code == 200, response.text
    return dict(response.json())


def _openai_embed(server: Any, texts: list[str]) -> dict[str, Any]:
    body = {"model": MODEL, "input": texts, "encoding_format": "float"}
    response = server.post("/v1/embeddings", json=body)
    assert response.status_code == 200, response.text
    return dict(response.json())


# embed/test_cohere_online.py: text embedding


def test_basic_embed(server: Any, st: SentenceTransformer) -> None:
    answer = _cohere_embed(server, texts=["hello world"], embedding_types=["float"])
    assert "embeddings" in answer
    assert len(answer["embeddings"]["float"]) == 1
    assert len(answer["embeddings"]["float"][0]) > 0
    assert_close(answer["embeddings"]["float"], st.encode(["hello world"]))


def test_unsupported_input_type_rejected(server: Any) -> None:
    """vLLM: 400 `Unsupported input_type ...` (it reads any word against the model's prompts).
    Difference kept: here `input_type` is Cohere's enumeration, so an unknown word is refused by
    the body's schema, in its words: the field, the accepted values and the value sent
    (docs/api.md, POST /v2/embed)."""
    body = {
        "model": MODEL,
        "input_type": "nonexistent_type",
        "texts": ["hello world"],
        "embedding_types": ["float"],
    }
    response = server.post("/v2/embed", json=body)
    assert response.status_code == 400
    error = response.json()["error"]
    assert error["param"] == "input_type"
    assert "'nonexistent_type'" in error["message"]


def test_omitted_input_type_accepted(server: Any) -> None:
    answer = _cohere_embed(server, texts=["hello world"], embedding_types=["float"])
    assert len(answer["embeddings"]["float"]) == 1


def test_v1_v2_parity(server: Any) -> None:
    texts = ["hello world"]
    v2 = _cohere_embed(server, texts=texts, embedding_types=["float"])
    v1 = _openai_embed(server, texts)
    assert cosine(v2["embeddings"]["float"][0], v1["data"][0]["embedding"]) > 0.9999


def test_embedding_types(server: Any) -> None:
    answer = _cohere_embed(server, texts=["test"], embedding_types=["float", "binary", "ubinary"])
    dim = len(answer["embeddings"]["float"][0])
    assert len(answer["embeddings"]["binary"][0]) == dim // 8
    assert len(answer["embeddings"]["ubinary"][0]) == dim // 8


def test_response_structure(server: Any) -> None:
    answer = _cohere_embed(server, texts=["test"], embedding_types=["float"])
    assert "id" in answer
    assert "embeddings" in answer
    assert answer["texts"] == ["test"]
    assert answer["meta"]["api_version"]["version"] == "2"
    assert answer["meta"]["tokens"]["input_tokens"] > 0


def test_batch(server: Any, st: SentenceTransformer) -> None:
    texts = ["apple", "banana", "cherry"]
    answer = _cohere_embed(server, texts=texts, embedding_types=["float"])
    floats = answer["embeddings"]["float"]
    assert len(floats) == 3
    assert all(len(vector) == len(floats[0]) for vector in floats)
    assert_close(floats, st.encode(texts))


def test_l2_normalized(server: Any) -> None:
    answer = _cohere_embed(server, texts=["hello world"], embedding_types=["float"])
    assert abs(float(np.linalg.norm(answer["embeddings"]["float"][0])) - 1.0) < 0.01


def test_semantic_similarity(server: Any) -> None:
    texts = ["machine learning", "deep learning", "chocolate cake recipe"]
    floats = _cohere_embed(server, texts=texts, embedding_types=["float"])["embeddings"]["float"]
    assert cosine(floats[0], floats[1]) > cosine(floats[0], floats[2])


def test_missing_input_returns_error(server: Any) -> None:
    assert server.post("/v2/embed", json={"model": MODEL}).status_code == 400


def test_base64_embedding_type(server: Any) -> None:
    answer = _cohere_embed(server, texts=["test encoding"], embedding_types=["float", "base64"])
    floats = answer["embeddings"]["float"][0]
    decoded = struct.unpack(f"<{len(floats)}f", base64.b64decode(answer["embeddings"]["base64"][0]))
    np.testing.assert_allclose(floats, decoded, rtol=1e-5)


# embed/test_cohere_online.py: truncation


def _long(server: Any, truncate: str, text: str = LONG_TEXT) -> Any:
    body = {"model": MODEL, "texts": [text], "embedding_types": ["float"], "truncate": truncate}
    return server.post("/v2/embed", json=body)


@pytest.mark.parametrize("truncate", ["END", "START"])
def test_truncate_end_and_start_succeed(server: Any, truncate: str) -> None:
    """vLLM's test_truncate_end_succeeds and test_truncate_start_succeeds."""
    response = _long(server, truncate)
    assert response.status_code == 200, response.text
    assert len(response.json()["embeddings"]["float"]) == 1


def test_truncate_none_rejects_long_input(server: Any) -> None:
    assert _long(server, "NONE").status_code == 400


def test_truncate_start_vs_end_differ(server: Any, st: SentenceTransformer) -> None:
    """vLLM's test_truncate_start_vs_end_differ: distinct words at each end; END keeps the
    start and equals sentence-transformers' own cut (MiniLM's max_seq_length)."""
    start_words = " ".join(f"alpha{i}" for i in range(300))
    end_words = " ".join(f"omega{i}" for i in range(300))
    text = f"{start_words} {end_words}"
    kept_start = _long(server, "END", text).json()["embeddings"]["float"][0]
    kept_end = _long(server, "START", text).json()["embeddings"]["float"][0]
    assert cosine(kept_start, kept_end) < 0.99
    assert_close(kept_start, st.encode(text))


# embed/test_cohere_openai_parity.py


def test_single_text_parity(server: Any) -> None:
    texts = ["the quick brown fox jumps over the lazy dog"]
    v2 = _cohere_embed(server, texts=texts, embedding_types=["float"])["embeddings"]["float"]
    v1 = [d["embedding"] for d in _openai_embed(server, texts)["data"]]
    assert cosine(v2[0], v1[0]) > 0.9999


def test_batch_parity(server: Any) -> None:
    texts = ["machine learning", "deep learning", "natural language processing"]
    v2 = _cohere_embed(server, texts=texts, embedding_types=["float"])["embeddings"]["float"]
    v1 = [d["embedding"] for d in _openai_embed(server, texts)["data"]]
    assert len(v2) == len(v1) == 3
    similarities = np.array([[cosine(a, b) for b in v1] for a in v2])
    for i in range(3):
        assert int(np.argmax(similarities[i])) == i
        assert similarities[i, i] > 0.9999


def test_token_count_parity(server: Any) -> None:
    texts = ["hello world"]
    v2 = _cohere_embed(server, texts=texts, embedding_types=["float"])
    v1 = _openai_embed(server, texts)
    assert v2["meta"]["billed_units"]["input_tokens"] == v1["usage"]["prompt_tokens"]
