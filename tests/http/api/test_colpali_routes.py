"""ColPali (a late-interaction retriever) on the routes, served in process on a tiny random
checkpoint (tests/tiny_vl.py), each prompt whole (PaliGemma attends both ways): /score and
/v1/rerank score a text query against image (and text) documents by MaxSim of their token
vectors, equal transformers' score_retrieval of each pair alone; /pooling's token_embed of an
image document (vLLM's messages with one image_url part) and of a text (its query form, the
BOS written once) equals ColPaliForRetrieval's embeddings; a document with text beside its
image is refused."""

from __future__ import annotations

import base64
import io
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from PIL import Image
from starlette.testclient import TestClient

from poolserve.config.settings import ServerSettings
from poolserve.http.app import create_app
from tests.tiny_vl import ColPaliReference, image, save_tiny_colpali

NAME = "colpali"
QUERY = "What is 42?"
PICTURES = [image(60, 40, seed=1), image(33, 90, seed=2), image(120, 120, seed=3)]
# documents by their parts: a string is a text, an int the index of a picture
DOCUMENTS: tuple[str | int, ...] = (0, "ab cd", 1, 2)


def _data_url(picture: Image.Image) -> str:
    buffer = io.BytesIO()
    picture.save(buffer, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode()


def _part(document: str | int) -> dict[str, Any]:
    """vLLM's content part of one document."""
    if isinstance(document, str):
        return {"type": "text", "text": document}
    return {"type": "image_url", "image_url": {"url": _data_url(PICTURES[document])}}


PARTS = [_part(document) for document in DOCUMENTS]


@pytest.fixture(scope="module")
def directory(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_tiny_colpali(tmp_path_factory.mktemp("colpali"))


@pytest.fixture(scope="module")
def reference(directory: Path) -> ColPaliReference:
    return ColPaliReference(directory)


@pytest.fixture(scope="module")
def client(directory: Path) -> Iterator[TestClient]:
    served = ServerSettings(
        model=str(directory),
        served_model_name=NAME,
        max_images_per_request=5,
        max_model_len=256,  # a bidirectional model's step holds its longest prompt
    )
    with TestClient(create_app(served)) as client:
        yield client


def _ok(response: Any) -> Any:
    assert response.status_code == 200, response.text
    return response.json()


def _embeddings(reference: ColPaliReference, document: str | int) -> torch.Tensor:
    """A document's reference vectors: a text as the processor writes a text (a query), an
    image as its visual prompt."""
    if isinstance(document, str):
        return reference.query(document)[1]
    return reference.document(PICTURES[document])[1]


def test_score_and_rerank_are_maxsim_of_transformers(
    client: TestClient, reference: ColPaliReference
) -> None:
    query = reference.query(QUERY)[1]
    want = [reference.maxsim(query, _embeddings(reference, d)) for d in DOCUMENTS]
    body = {"model": NAME, "queries": QUERY, "documents": {"content": PARTS}}
    answer = _ok(client.post("/score", json=body))
    got = [item["score"] for item in answer["data"]]
    assert np.allclose(got, want, rtol=1e-4, atol=0)
    rerank = {"model": NAME, "query": QUERY, "documents": {"content": PARTS}, "top_n": 3}
    results = _ok(client.post("/v1/rerank", json=rerank))["results"]
    best = list(np.argsort(-np.asarray(want), kind="stable")[:3])
    assert [r["index"] for r in results] == best
    assert np.allclose([r["relevance_score"] for r in results], sorted(want)[::-1][:3], rtol=1e-4)


def test_pooling_token_embed_of_an_image_document(
    client: TestClient, reference: ColPaliReference
) -> None:
    messages = [{"role": "user", "content": [_part(2)]}]
    body = {"model": NAME, "task": "token_embed", "messages": messages}
    data = np.asarray(_ok(client.post("/pooling", json=body))["data"][0]["data"])
    want = _embeddings(reference, 2).numpy()
    assert data.shape == want.shape
    assert float(np.abs(data - want).max()) <= 1e-4


def test_a_document_is_one_image_alone(client: TestClient) -> None:
    content = [_part(0), {"type": "text", "text": "ab"}]
    body = {
        "model": NAME,
        "task": "token_embed",
        "messages": [{"role": "user", "content": content}],
    }
    response = client.post("/pooling", json=body)
    assert response.status_code == 400
    assert "one image alone" in response.json()["error"]["message"]


def test_a_plain_text_is_a_query_on_every_route(
    client: TestClient, reference: ColPaliReference
) -> None:
    """A text is written as the processor writes any text (its query form), whether it comes
    alone to /pooling, beside an image document, or in a text-only /score pair."""
    query = reference.query(QUERY)[1]
    body = {"model": NAME, "task": "token_embed", "input": QUERY}
    data = np.asarray(_ok(client.post("/pooling", json=body))["data"][0]["data"])
    assert data.shape == query.shape
    assert float(np.abs(data - query.numpy()).max()) <= 1e-4
    pair = {"model": NAME, "queries": QUERY, "documents": ["ab cd", "x"]}
    got = [item["score"] for item in _ok(client.post("/score", json=pair))["data"]]
    want = [reference.maxsim(query, reference.query(text)[1]) for text in ("ab cd", "x")]
    assert np.allclose(got, want, rtol=1e-4, atol=0)


def test_token_embed_streams_as_for_texts(client: TestClient, reference: ColPaliReference) -> None:
    """`stream: true` on /pooling: one ndjson line per input as it finishes, an image document's
    vectors equal to the reference's, then the usage line."""
    messages = [{"role": "user", "content": [_part(1)]}]
    body = {"model": NAME, "task": "token_embed", "messages": messages, "stream": True}
    response = client.post("/pooling", json=body)
    assert response.status_code == 200
    assert response.headers["content-type"].startswith("application/x-ndjson")
    lines = [json.loads(line) for line in response.text.splitlines()]
    assert [line.get("object") for line in lines] == ["pooling", "usage"]
    want = _embeddings(reference, 1).numpy()
    assert float(np.abs(np.asarray(lines[0]["data"]) - want).max()) <= 1e-4
