"""Voyage's, NIM's and Jina's fields on /v1/embeddings: each equals the request it names in the
service's own fields, quantized types equal sentence-transformers' `quantize_embeddings`, and a
field that repeats another's choice must agree with it."""

from __future__ import annotations

import base64
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import pytest
from sentence_transformers import quantize_embeddings

TEXTS = ["hello world", "the cat sat on the mat", "poolserve serves pooled outputs"]
LONG = " ".join(f"word{i}" for i in range(400))  # far beyond MiniLM's 256 tokens
QUANTIZED = ["int8", "uint8", "binary", "ubinary"]
WIRE = {"int8": np.int8, "uint8": np.uint8, "binary": np.int8, "ubinary": np.uint8}


@pytest.fixture(scope="module")
def client(make_client: Callable[..., Any]) -> Iterator[Any]:
    with make_client(None) as started:
        yield started


def _data(client: Any, **body: Any) -> list[Any]:
    response = client.post("/v1/embeddings", json=body)
    assert response.status_code == 200, response.text
    return [item["embedding"] for item in response.json()["data"]]


def _error(client: Any, param: str, **body: Any) -> str:
    response = client.post("/v1/embeddings", json=body)
    assert response.status_code == 400, response.text
    if "truncation" in body:  # Voyage's request: Voyage's body, the message naming the field
        detail: str = response.json()["detail"]
        assert param in detail, detail
        return detail
    error = response.json()["error"]
    assert error["param"] == param, error
    message: str = error["message"]
    return message


def _st(floats: np.ndarray, kind: str) -> np.ndarray:
    """sentence-transformers' quantization over the documented fixed range [-1, 1]."""
    dim = floats.shape[-1]
    units = floats / np.linalg.norm(floats, axis=-1, keepdims=True)
    ranges = np.array([[-1.0] * dim, [1.0] * dim], dtype=np.float32)
    return np.asarray(quantize_embeddings(units, precision=kind, ranges=ranges))  # type: ignore[arg-type]


@pytest.mark.parametrize("kind", QUANTIZED)
@pytest.mark.parametrize("field", ["output_dtype", "embedding_type"])
def test_quantized_types_are_sentence_transformers_of_the_floats(
    client: Any, kind: str, field: str
) -> None:
    floats = np.asarray(_data(client, input=TEXTS), dtype=np.float32)
    want = _st(floats, kind)
    got = np.asarray(_data(client, input=TEXTS, **{field: kind}))
    assert got.shape == want.shape and np.array_equal(got, want)
    # base64 carries the same integers, one byte each (Voyage's client decodes by output_dtype)
    coded = _data(client, input=TEXTS, encoding_format="base64", **{field: kind})
    decoded = np.stack([np.frombuffer(base64.b64decode(text), WIRE[kind]) for text in coded])
    assert np.array_equal(decoded, want)


def test_float_output_types_and_jina_base64(client: Any) -> None:
    floats = _data(client, input=TEXTS)
    assert _data(client, input=TEXTS, output_dtype="float") == floats
    assert _data(client, input=TEXTS, embedding_type="float") == floats
    coded = _data(client, input=TEXTS, embedding_type="base64")
    assert coded == _data(client, input=TEXTS, encoding_format="base64")
    decoded = [np.frombuffer(base64.b64decode(text), np.float32).tolist() for text in coded]
    assert np.array_equal(np.asarray(decoded, np.float32), np.asarray(floats, np.float32))


def test_quantized_late_chunking_quantizes_each_span(client: Any) -> None:
    late = {"spans": [[[0, 5], [6, 11]]]}
    response = client.post("/v1/embeddings", json={"input": ["hello world"], "late_chunking": late})
    floats = np.asarray([item["embedding"] for item in response.json()["data"]], np.float32)
    body = {"input": ["hello world"], "late_chunking": late, "output_dtype": "int8"}
    items = client.post("/v1/embeddings", json=body).json()["data"]
    assert [item["span"] for item in items] == [[0, 5], [6, 11]]
    assert np.array_equal(np.asarray([item["embedding"] for item in items]), _st(floats, "int8"))


def test_other_names_of_dimensions_and_normalize(
    client: Any, make_client: Callable[..., Any]
) -> None:
    assert _data(client, input=TEXTS, normalized=False) == _data(
        client, input=TEXTS, normalize=False
    )
    _error(client, "normalized", input=TEXTS, normalize=True, normalized=False)
    with make_client(None, matryoshka_dimensions="64,32") as matryoshka:
        cut = _data(matryoshka, input=TEXTS, dimensions=64)
        assert len(cut[0]) == 64
        assert _data(matryoshka, input=TEXTS, output_dimension=64) == cut
        assert _data(matryoshka, input=TEXTS, dimensions=64, output_dimension=64) == cut
        _error(matryoshka, "output_dimension", input=TEXTS, dimensions=64, output_dimension=32)


@pytest.mark.parametrize(
    ("fields", "own"),
    [
        ({"truncate": "END"}, {"truncate_prompt_tokens": -1, "truncation_side": "right"}),
        ({"truncate": "START"}, {"truncate_prompt_tokens": -1, "truncation_side": "left"}),
        ({"truncate": True}, {"truncate_prompt_tokens": -1, "truncation_side": "right"}),
        ({"truncation": True}, {"truncate_prompt_tokens": -1, "truncation_side": "right"}),
    ],
)
def test_truncation_words_cut_as_the_service_does(
    client: Any, fields: dict[str, Any], own: dict[str, Any]
) -> None:
    assert _data(client, input=[LONG, "short"], **fields) == _data(
        client, input=[LONG, "short"], **own
    )


@pytest.mark.parametrize(
    "fields", [{"truncate": "NONE"}, {"truncate": False}, {"truncation": False}]
)
def test_truncation_refused_answers_400_for_an_over_long_input(
    client: Any, fields: dict[str, Any]
) -> None:
    response = client.post("/v1/embeddings", json={"input": [LONG], **fields})
    assert response.status_code == 400, response.text
    assert _data(client, input=["short"], **fields) == _data(client, input=["short"])


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"truncate": "END", "truncation": True}, "truncation"),
        ({"truncate": "END", "truncate_prompt_tokens": 8}, "truncate_prompt_tokens"),
        ({"output_dtype": "int8", "embedding_type": "binary"}, "embedding_type"),
        ({"output_dtype": "int8", "embed_dtype": "float16"}, "embed_dtype"),
        ({"output_dtype": "int8", "encoding_format": "bytes"}, "encoding_format"),
        ({"embedding_type": "base64", "encoding_format": "float"}, "encoding_format"),
        ({"input_type": "query", "prompt_name": "query"}, "input_type"),
    ],
)
def test_two_fields_that_choose_the_same_thing_must_agree(
    client: Any, body: dict[str, Any], param: str
) -> None:
    message = _error(client, param, input=TEXTS, **body)
    assert "send one of" in message or "disagree" in message or "not bytes" in message, message


@pytest.mark.parametrize(
    "body",
    [
        {"input_type": "search_query"},  # Cohere's word, on Cohere's route only
        {"output_dtype": "float16"},
        {"embedding_type": "int4"},
        {"truncate": "MIDDLE"},
        {"truncate": "true"},  # a string is not Jina's boolean
        {"truncation": "yes"},
    ],
)
def test_values_outside_each_vocabulary_answer_400(client: Any, body: dict[str, Any]) -> None:
    response = client.post("/v1/embeddings", json={"input": TEXTS, **body})
    assert response.status_code == 400, response.text
    assert next(iter(body)) in response.text


def test_input_type_keeps_a_model_without_prompts(client: Any) -> None:
    plain = _data(client, input=TEXTS)
    for input_type in ("query", "document", "passage"):
        assert _data(client, input=TEXTS, input_type=input_type) == plain


@pytest.mark.parametrize(
    ("route", "field", "value", "instead"),
    [
        ("/v1/embeddings", "embedding_types", ["int8"], "output_dtype"),
        ("/v1/embeddings", "max_tokens", 8, "truncate_prompt_tokens"),
        ("/v1/embeddings", "truncation_direction", "left", "truncation_side"),
        ("/v1/pooling", "output_dtype", "int8", "/v1/embeddings"),
        ("/v1/pooling", "input_type", "query", "prompt_name"),
        ("/v1/pooling", "truncate", "END", "truncate_prompt_tokens"),
        ("/v1/classify", "truncation_direction", "left", "truncation_side"),
    ],
)
def test_another_apis_field_that_would_change_the_answer_is_refused(
    client: Any, route: str, field: str, value: Any, instead: str
) -> None:
    message = _error_at(client, route, field, {"input": TEXTS, field: value})
    assert instead in message, message


@pytest.mark.parametrize(
    ("route", "body", "field", "status"),
    [
        # TEI answers a body off its schema with 422 (its `Validation` error type)
        ("/embed", {"inputs": TEXTS, "truncate_prompt_tokens": 8}, "truncate_prompt_tokens", 422),
        ("/embed", {"inputs": TEXTS, "input_type": "query"}, "input_type", 422),
        ("/v2/embed", {"texts": TEXTS, "dimensions": 64}, "dimensions", 400),
        ("/v2/embed", {"texts": TEXTS, "encoding_format": "base64"}, "encoding_format", 400),
    ],
)
def test_compat_routes_refuse_other_apis_names_for_their_own_choices(
    client: Any, route: str, body: dict[str, Any], field: str, status: int
) -> None:
    response = client.post(route, json=body)
    assert response.status_code == status, response.text
    assert field in response.text


def test_a_foreign_field_left_null_and_unknown_fields_are_still_only_logged(client: Any) -> None:
    plain = _data(client, input=TEXTS)
    assert _data(client, input=TEXTS, embedding_types=None, some_field_nobody_defines=1) == plain
    # huggingface_hub's InferenceClient sends encoding_format to TEI's /embed: still accepted
    response = client.post("/embed", json={"inputs": TEXTS, "encoding_format": "float"})
    assert response.status_code == 200, response.text


def _error_at(client: Any, route: str, param: str, body: dict[str, Any]) -> str:
    response = client.post(route, json=body)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param, error
    message: str = error["message"]
    return message


def test_voyages_requests_answer_voyages_error_body(client: Any) -> None:
    # Voyage's client always sends `truncation`: its errors come as {"detail": message}
    response = client.post("/v1/embeddings", json={"input": [LONG], "truncation": False})
    assert response.status_code == 400
    assert set(response.json()) == {"detail"} and "tokens" in response.json()["detail"]
    other = client.post("/v1/embeddings", json={"input": [LONG], "truncate": False})
    assert other.status_code == 400 and set(other.json()) == {"error"}
