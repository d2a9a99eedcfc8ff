"""The late-interaction retrievers on the routes, ColQwen2 and ColPali, each served in process on
a tiny random checkpoint (tests/tiny_vl.py): ColQwen2 in steps of 16 tokens, so documents run
chunked with an image across steps; ColPali's prompts whole (PaliGemma attends both ways).
/score and /v1/rerank score a text query against image (and text) documents by MaxSim of their
token vectors, equal to transformers' score_retrieval of each pair alone; /pooling's
token_embed of an image document (vLLM's messages with one image_url part) and of a text (its
query form) equals the reference's embeddings, streamed too; a document with text beside its
image is refused."""

from __future__ import annotations

import base64
import io
import json
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from PIL import Image
from starlette.testclient import TestClient

from poolserve.config.settings import ServerSettings
from poolserve.http.app import create_app
from tests.tiny_vl import (
    ColPaliReference,
    ColQwenReference,
    RetrieverReference,
    image,
    save_tiny_colpali,
    save_tiny_colqwen2,
)

PICTURES = [image(60, 40, seed=1), image(33, 90, seed=2), image(120, 120, seed=3)]


@dataclass(frozen=True)
class Retriever:
    """One retriever's tiny checkpoint, its reference, and texts its tiny vocabulary spells."""

    save: Callable[[Path], Path]
    reference: type[RetrieverReference]
    settings: dict[str, Any]
    query: str
    texts: tuple[str, str]  # two text documents


RETRIEVERS = {
    "colqwen2": Retriever(
        save_tiny_colqwen2,
        ColQwenReference,
        {"max_num_batched_tokens": 16},
        "w3 w4 the image. w5",
        ("w6 w7", "w1"),
    ),
    "colpali": Retriever(
        save_tiny_colpali,
        ColPaliReference,
        {"max_model_len": 256},  # a bidirectional model's step holds its longest prompt
        "What is 42?",
        ("ab cd", "x"),
    ),
}


def _data_url(picture: Image.Image) -> str:
    buffer = io.BytesIO()
    picture.save(buffer, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode()


def _part(document: str | int) -> dict[str, Any]:
    """vLLM's content part of one document: a string is a text, an int the index of a picture."""
    if isinstance(document, str):
        return {"type": "text", "text": document}
    return {"type": "image_url", "image_url": {"url": _data_url(PICTURES[document])}}


class Served:
    """One retriever served in process, with its reference."""

    def __init__(self, name: str, client: TestClient, directory: Path) -> None:
        self.name = name
        self.client = client
        self.spec = RETRIEVERS[name]
        self.reference = self.spec.reference(directory)
        # documents by their parts: pictures and one text
        self.documents: tuple[str | int, ...] = (0, self.spec.texts[0], 1, 2)

    def post(self, path: str, **body: Any) -> Any:
        response = self.client.post(path, json={"model": self.name, **body})
        assert response.status_code == 200, response.text
        return response.json()

    def vectors(self, document: str | int) -> torch.Tensor:
        """A document's reference vectors: a text as the processor writes any text (a query),
        an image as its visual prompt."""
        if isinstance(document, str):
            return self.reference.query(document)[1]
        return self.reference.document(PICTURES[document])[1]  # type: ignore[attr-defined]


@pytest.fixture(scope="module", params=sorted(RETRIEVERS))
def served(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Served]:
    name = request.param
    spec = RETRIEVERS[name]
    directory = spec.save(tmp_path_factory.mktemp(name))
    settings = ServerSettings(
        model=str(directory), served_model_name=name, max_images_per_request=5, **spec.settings
    )
    with TestClient(create_app(settings)) as client:
        yield Served(name, client, directory)


def _close(got: Any, want: torch.Tensor) -> None:
    data = np.asarray(got)
    assert data.shape == tuple(want.shape)
    assert float(np.abs(data - want.numpy()).max()) <= 1e-4


def test_score_and_rerank_are_maxsim_of_transformers(served: Served) -> None:
    query, parts = served.spec.query, [_part(d) for d in served.documents]
    vectors = served.reference.query(query)[1]
    want = [served.reference.maxsim(vectors, served.vectors(d)) for d in served.documents]
    answer = served.post("/score", queries=query, documents={"content": parts})
    assert np.allclose([item["score"] for item in answer["data"]], want, rtol=1e-4, atol=0)
    results = served.post("/v1/rerank", query=query, documents={"content": parts}, top_n=3)
    best = list(np.argsort(-np.asarray(want), kind="stable")[:3])
    assert [r["index"] for r in results["results"]] == best
    scores = [r["relevance_score"] for r in results["results"]]
    assert np.allclose(scores, sorted(want)[::-1][:3], rtol=1e-4)


def test_pooling_token_embed_of_an_image_document(served: Served) -> None:
    messages = [{"role": "user", "content": [_part(2)]}]
    answer = served.post("/pooling", task="token_embed", messages=messages)
    _close(answer["data"][0]["data"], served.vectors(2))


def test_a_document_is_one_image_alone(served: Served) -> None:
    content = [_part(0), _part(served.spec.texts[1])]
    body = {"task": "token_embed", "messages": [{"role": "user", "content": content}]}
    response = served.client.post("/pooling", json={"model": served.name, **body})
    assert response.status_code == 400
    assert "one image alone" in response.json()["error"]["message"]


def test_a_plain_text_is_a_query_on_every_route(served: Served) -> None:
    """A text is written as the processor writes any text (its query form), whether it comes
    alone to /pooling, beside an image document, or in a text-only /score pair."""
    query = served.reference.query(served.spec.query)[1]
    answer = served.post("/pooling", task="token_embed", input=served.spec.query)
    _close(answer["data"][0]["data"], query)
    texts = list(served.spec.texts)
    got = [
        i["score"]
        for i in served.post("/score", queries=served.spec.query, documents=texts)["data"]
    ]
    want = [served.reference.maxsim(query, served.reference.query(text)[1]) for text in texts]
    assert np.allclose(got, want, rtol=1e-4, atol=0)


def test_token_embed_streams_as_for_texts(served: Served) -> None:
    """`stream: true` on /pooling: one ndjson line per input as it finishes, an image document's
    vectors equal to the reference's, then the usage line."""
    messages = [{"role": "user", "content": [_part(1)]}]
    body = {"model": served.name, "task": "token_embed", "messages": messages, "stream": True}
    response = served.client.post("/pooling", json=body)
    assert response.status_code == 200
    assert response.headers["content-type"].startswith("application/x-ndjson")
    lines = [json.loads(line) for line in response.text.splitlines()]
    assert [line.get("object") for line in lines] == ["pooling", "usage"]
    _close(lines[0]["data"], served.vectors(1))


@pytest.mark.parametrize("route", ["/score", "/score images", "/pooling"])
def test_the_clients_texts_are_checked_before_their_query_form(served: Served, route: str) -> None:
    """An empty text is refused as on any model (its query form is not empty), and a lone
    surrogate is reported at its place in the client's own text."""
    documents: Any = {"content": [_part(0)]} if route.endswith("images") else ["a b"]
    for text, words in (("", "empty"), ("ab\ud800", "surrogate U+D800 at character 2")):
        if route == "/pooling":
            body = {"task": "token_embed", "input": text}
        else:
            body = {"queries": [text], "documents": documents}
        response = served.client.post(
            route.split()[0],
            content=json.dumps({"model": served.name, **body}),
            headers={"content-type": "application/json"},
        )
        assert response.status_code == 400, response.text
        assert words in response.json()["error"]["message"]
