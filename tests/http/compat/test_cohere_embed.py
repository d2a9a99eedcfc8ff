"""Cohere's `POST /v2/embed` through the app: translation, truncation, refusals, quantisation."""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import pytest

from poolserve.frontend.quantize import QUANTIZERS

TEXTS = ["hello world", "the cat sat on the mat", "poolserve serves pooled outputs"]
LONG = " ".join(f"word{i}" for i in range(400))  # far beyond MiniLM's 256 tokens


@pytest.fixture(scope="module")
def client(make_client: Callable[..., Any]) -> Iterator[Any]:
    with make_client(None) as started:
        yield started


def _embed(client: Any, **body: Any) -> dict[str, Any]:
    response = client.post("/v2/embed", json=body)
    assert response.status_code == 200, response.text
    answer: dict[str, Any] = response.json()
    return answer


def _openai(client: Any, **body: Any) -> dict[str, Any]:
    response = client.post("/v1/embeddings", json=body)
    assert response.status_code == 200, response.text
    answer: dict[str, Any] = response.json()
    return answer


def _error(client: Any, body: dict[str, Any], param: str) -> str:
    response = client.post("/v2/embed", json=body)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param, error
    message: str = error["message"]
    return message


def test_float_equals_the_openai_route_with_cohere_fields(client: Any) -> None:
    answer = _embed(client, texts=TEXTS, input_type="search_document", embedding_types=["float"])
    own = _openai(client, input=TEXTS)
    assert answer["response_type"] == "embeddings_by_type"
    assert answer["texts"] == TEXTS
    assert set(answer["embeddings"]) == {"float"}
    assert answer["embeddings"]["float"] == [d["embedding"] for d in own["data"]]
    tokens = own["usage"]["prompt_tokens"]
    assert answer["meta"]["billed_units"] == {"input_tokens": tokens}
    assert answer["meta"]["api_version"] == {"version": "2"}
    assert answer["id"] != _embed(client, texts=TEXTS, input_type="search_query")["id"]


def test_float_is_the_default_and_input_type_keeps_a_model_without_prompts(client: Any) -> None:
    plain = _embed(client, texts=TEXTS)["embeddings"]
    assert set(plain) == {"float"}
    for input_type in ("search_document", "search_query", "classification", "clustering"):
        got = _embed(client, texts=TEXTS, input_type=input_type)["embeddings"]
        assert got == plain


def test_every_type_at_once_is_each_type_of_the_same_floats(client: Any) -> None:
    kinds = ["ubinary", "float", "int8", "binary", "uint8", "int8"]
    embeddings = _embed(client, texts=TEXTS, embedding_types=kinds)["embeddings"]
    assert list(embeddings) == ["ubinary", "float", "int8", "binary", "uint8"]
    floats = np.asarray(embeddings["float"], dtype=np.float32)
    for kind in ("int8", "uint8", "binary", "ubinary"):
        assert np.array_equal(np.asarray(embeddings[kind]), QUANTIZERS[kind](floats)), kind
    assert np.asarray(embeddings["binary"]).shape == (len(TEXTS), floats.shape[1] // 8)


@pytest.mark.parametrize(
    ("truncate", "max_tokens", "own"),
    [
        ("END", None, {"truncate_prompt_tokens": -1, "truncation_side": "right"}),
        ("START", None, {"truncate_prompt_tokens": -1, "truncation_side": "left"}),
        ("START", 8, {"truncate_prompt_tokens": 8, "truncation_side": "left"}),
        (None, 8, {"truncate_prompt_tokens": 8, "truncation_side": "right"}),
    ],
)
def test_truncate_and_max_tokens_cut_as_the_service_does(
    client: Any, truncate: str | None, max_tokens: int | None, own: dict[str, Any]
) -> None:
    body: dict[str, Any] = {"texts": [LONG, "short"]}
    if truncate is not None:
        body["truncate"] = truncate
    if max_tokens is not None:
        body["max_tokens"] = max_tokens
    answer = _embed(client, **body)
    reference = _openai(client, input=[LONG, "short"], **own)
    assert answer["embeddings"]["float"] == [d["embedding"] for d in reference["data"]]
    assert answer["meta"]["billed_units"]["input_tokens"] == reference["usage"]["prompt_tokens"]


def test_start_and_end_keep_different_ends(client: Any) -> None:
    start = _embed(client, texts=[LONG], truncate="START")["embeddings"]["float"]
    end = _embed(client, texts=[LONG], truncate="END")["embeddings"]["float"]
    assert not np.allclose(start, end, atol=1e-3)


def test_text_only_inputs_equal_texts(client: Any) -> None:
    inputs = [{"content": [{"type": "text", "text": t}]} for t in TEXTS]
    assert _embed(client, inputs=inputs)["embeddings"] == _embed(client, texts=TEXTS)["embeddings"]


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"images": ["data:image/png;base64,AAAA"], "input_type": "image"}, "images"),
        ({"texts": ["a"], "images": ["data:image/png;base64,AAAA"]}, "images"),
        (
            {"inputs": [{"content": [{"type": "image_url", "image_url": {"url": "x"}}]}]},
            "inputs",
        ),
        ({"texts": ["a"], "embedding_types": ["int4"]}, "embedding_types"),
        ({"texts": ["a"], "truncate": "MIDDLE"}, "truncate"),
        ({"texts": ["a", LONG], "truncate": "NONE", "max_tokens": 8}, "max_tokens"),
        ({"texts": ["a"], "max_tokens": 0}, "max_tokens"),
        ({"texts": []}, "texts"),
        ({"texts": ["a", ""]}, "texts"),
        ({"input_type": "search_query"}, "texts"),
        ({"texts": ["a"], "inputs": [{"content": [{"type": "text", "text": "a"}]}]}, "texts"),
        ({"texts": ["a"], "output_dimension": 128}, "dimensions"),
        ({"texts": ["a"], "input_type": "poem"}, "input_type"),
    ],
)
def test_refusals_are_clear_400s(client: Any, body: dict[str, Any], param: str) -> None:
    _error(client, body, param)


def test_truncate_none_refuses_what_the_model_would_cut(client: Any) -> None:
    # MiniLM's sentence-transformers config cuts at 256 tokens; Cohere's NONE refuses instead
    response = client.post("/v2/embed", json={"texts": [LONG], "truncate": "NONE"})
    assert response.status_code == 400, response.text
    assert response.json()["error"]["code"] == "context_length_exceeded"
    assert "256" in response.json()["error"]["message"]
    # END cuts where sentence-transformers does: the service's own default
    answer = _embed(client, texts=[LONG], truncate="END")
    assert answer["embeddings"]["float"] == [_openai(client, input=[LONG])["data"][0]["embedding"]]


def test_too_many_texts_and_another_model_are_refused(make_client: Callable[..., Any]) -> None:
    with make_client(None, max_client_batch_size=2) as small:
        message = _error(small, {"texts": ["a", "b", "c"]}, "texts")
        assert "--max-client-batch-size" in message
        response = small.post("/v2/embed", json={"texts": ["a"], "model": "embed-v4.0"})
        assert response.status_code == 404, response.text


def test_output_dimension_on_a_matryoshka_model(make_client: Callable[..., Any]) -> None:
    overrides = json.dumps({"is_matryoshka": True})
    with make_client(None, hf_overrides=overrides) as matryoshka:
        answer = _embed(matryoshka, texts=TEXTS, output_dimension=128, embedding_types=["float"])
        own = _openai(matryoshka, input=TEXTS, dimensions=128)
    floats = answer["embeddings"]["float"]
    assert [len(v) for v in floats] == [128] * len(TEXTS)
    assert floats == [d["embedding"] for d in own["data"]]


def test_unknown_fields_are_accepted_and_named_in_a_warning(
    client: Any, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level("WARNING", logger="poolserve.http.bodies"):
        got = _embed(client, texts=TEXTS, unknown_field=1)["embeddings"]
    assert got == _embed(client, texts=TEXTS)["embeddings"]
    assert "CohereEmbedRequest: ignored unknown fields unknown_field" in caplog.text
