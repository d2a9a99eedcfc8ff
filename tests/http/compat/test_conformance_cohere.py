"""Cohere's `POST /v2/embed` on the wire: the API reference's examples through the `cohere` SDK.

Examples replayed as Cohere documents them (cohere-ai/cohere-developer-experience e814c8a,
`cohere-openapi.yaml` `/v2/embed` x-fern-examples, and the `ClientV2.embed` docstring of the
`cohere` SDK 7.3.1); the SDK (over httpx, in process) must parse every answer, and the values are
sentence-transformers' for the bundled MiniLM, served under Cohere's model names as aliases.
"""

from __future__ import annotations

import base64
import json
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import cohere
import numpy as np
import pytest
from sentence_transformers import SentenceTransformer, quantize_embeddings
from starlette.testclient import TestClient

from poolserve.config.settings import ServerSettings
from poolserve.http.app import create_app
from tests.http.serving import assert_close
from tests.tiny_models import minilm_path

# the SDK passes a timeout on every call, which Starlette's in-process client only warns about
pytestmark = pytest.mark.filterwarnings("ignore:You should not use the 'timeout' argument")
NAMES = ["minilm", "embed-v4.0", "embed-v5.0-fast"]
# The API reference's request bodies, unchanged (texts; one input of two text parts; the SDK's).
TEXTS_EXAMPLE = {
    "texts": ["hello", "goodbye"],
    "model": "embed-v4.0",
    "input_type": "classification",
    "embedding_types": ["float"],
}
INPUTS_EXAMPLE = {
    "inputs": [
        {"content": [{"type": "text", "text": "hello"}, {"type": "text", "text": "goodbye"}]}
    ],
    "model": "embed-v4.0",
    "input_type": "classification",
    "embedding_types": ["float"],
}
SDK_DOCSTRING_EXAMPLE = {
    "texts": ["hello", "goodbye"],
    "model": "embed-v5.0-fast",
    "input_type": "search_document",
    "embedding_types": ["float"],
}
JAVA_EXAMPLE = {
    "model": "embed-v4.0",
    "input_type": "classification",
    "texts": ["hello", "goodbye"],
}
# EmbedByTypeResponse's fields (the SDK's model and the OpenAPI schema)
RESPONSE_FIELDS = {"id", "embeddings", "texts", "images", "meta", "response_type"}
LONG = " ".join(f"word{i}" for i in range(400))  # beyond MiniLM's 256 tokens


@pytest.fixture(scope="module", params=["app", "live"])
def server(request: pytest.FixtureRequest) -> Iterator[Any]:
    """MiniLM behind the in-process app (with an API key, which the SDK sends) and behind a
    real server process."""
    if request.param == "live":
        yield request.getfixturevalue("live_minilm")
        return
    settings = ServerSettings(model=None, served_model_name=NAMES, api_key="test-key")
    with TestClient(create_app(settings)) as client:
        client.headers["authorization"] = "Bearer test-key"
        yield client


@pytest.fixture(scope="module")
def co(server: TestClient) -> cohere.ClientV2:
    return cohere.ClientV2(base_url=str(server.base_url), api_key="test-key", httpx_client=server)


@pytest.fixture(scope="module")
def st() -> SentenceTransformer:
    return SentenceTransformer(str(minilm_path()), device="cpu")


def _tokens(st: SentenceTransformer, texts: list[str]) -> int:
    return sum(len(st.tokenizer(text)["input_ids"]) for text in texts)


@pytest.mark.parametrize("example", [TEXTS_EXAMPLE, SDK_DOCSTRING_EXAMPLE, JAVA_EXAMPLE])
def test_texts_examples_through_the_sdk(
    co: cohere.ClientV2, st: SentenceTransformer, example: dict[str, Any]
) -> None:
    answer = co.embed(**example)
    texts = example["texts"]
    assert_close(answer.embeddings.float_, st.encode(texts))
    assert answer.texts == texts and answer.response_type == "embeddings_by_type"
    assert uuid.UUID(answer.id).version == 4
    assert answer.meta is not None and answer.meta.api_version is not None
    assert answer.meta.api_version.version == "2"
    assert answer.meta.billed_units is not None and answer.meta.tokens is not None
    assert answer.meta.billed_units.input_tokens == _tokens(st, texts)
    assert answer.meta.tokens.input_tokens == _tokens(st, texts)
    assert answer.embeddings.int8 is None and answer.embeddings.base64 is None


def test_curl_example_answers_only_cohere_fields(server: TestClient) -> None:
    response = server.post("/v2/embed", json=TEXTS_EXAMPLE)
    assert response.status_code == 200, response.text
    answer = response.json()
    assert set(answer) <= RESPONSE_FIELDS and set(answer["embeddings"]) == {"float"}
    assert set(answer["meta"]) <= {"api_version", "billed_units", "tokens", "warnings"}


def test_one_input_of_two_text_parts_is_one_embedding(
    co: cohere.ClientV2, st: SentenceTransformer
) -> None:
    # Cohere answers one embedding per input; its text parts join as vLLM joins them
    answer = co.embed(**INPUTS_EXAMPLE)
    assert_close(answer.embeddings.float_, st.encode(["hello\ngoodbye"]))
    assert answer.texts == ["hello\ngoodbye"]


def test_the_image_example_is_refused(co: cohere.ClientV2) -> None:
    with pytest.raises(cohere.errors.BadRequestError) as refused:
        co.embed(
            model="embed-v4.0",
            input_type="image",
            embedding_types=["float"],
            images=["data:image/jpeg;base64,/9j/4AAQSkZJRgABAQAAAQABAAD"],
        )
    assert refused.value.body["error"]["param"] == "images"


def test_every_embedding_type_parses_and_follows_its_rule(
    co: cohere.ClientV2, st: SentenceTransformer
) -> None:
    texts = ["hello_world", "the cat sat on the mat"]
    kinds = ["float", "int8", "uint8", "binary", "ubinary", "base64"]
    got = co.embed(
        model="embed-v4.0", input_type="search_document", texts=texts, embedding_types=kinds
    )
    floats = np.asarray(got.embeddings.float_, dtype=np.float32)
    assert_close(floats, st.encode(texts))
    # base64: the float embedding's little-endian float32 bytes, as vLLM's /v2/embed sends them
    assert got.embeddings.base64 is not None
    decoded = [np.frombuffer(base64.b64decode(b), dtype="<f4") for b in got.embeddings.base64]
    assert np.array_equal(np.stack(decoded), floats)
    ranges = np.array([[-1.0] * floats.shape[1], [1.0] * floats.shape[1]], dtype=np.float32)
    for kind in ("int8", "uint8", "binary", "ubinary"):
        want = quantize_embeddings(floats, precision=kind, ranges=ranges)  # type: ignore[arg-type]
        assert np.array_equal(np.asarray(getattr(got.embeddings, kind)), want), kind


@pytest.mark.parametrize(("truncate", "side"), [("END", "right"), ("START", "left")])
def test_max_tokens_cuts_as_sentence_transformers_does(
    co: cohere.ClientV2, st: SentenceTransformer, truncate: str, side: str
) -> None:
    texts = [LONG, "short text"]
    got = co.embed(
        model="minilm", input_type="search_query", texts=texts, max_tokens=8, truncate=truncate
    )
    kept, st.max_seq_length, st.tokenizer.truncation_side = st.max_seq_length, 8, side
    try:
        want = st.encode(texts)
    finally:
        st.max_seq_length, st.tokenizer.truncation_side = kept, "right"
    assert_close(got.embeddings.float_, want)


def test_truncate_none_refuses_texts_over_max_tokens(
    co: cohere.ClientV2, st: SentenceTransformer
) -> None:
    # vLLM's rule for NONE with max_tokens: refuse, never cut, an input longer than max_tokens
    fits = co.embed(
        model="minilm", input_type="clustering", texts=["hello"], max_tokens=3, truncate="NONE"
    )
    assert_close(fits.embeddings.float_, st.encode(["hello"]))
    with pytest.raises(cohere.errors.BadRequestError) as refused:
        co.embed(
            model="minilm",
            input_type="clustering",
            texts=["hello", LONG],
            max_tokens=8,
            truncate="NONE",
        )
    assert refused.value.body["error"]["param"] == "max_tokens"
    # without max_tokens the model's limit applies: above sentence-transformers' max_seq_length
    # NONE refuses (Cohere: "an error is returned"), where END cuts as sentence-transformers does
    with pytest.raises(cohere.errors.BadRequestError) as too_long:
        co.embed(model="minilm", input_type="clustering", texts=[LONG], truncate="NONE")
    assert too_long.value.body["error"]["code"] == "context_length_exceeded"
    cut = co.embed(model="minilm", input_type="clustering", texts=[LONG], truncate="END")
    assert_close(cut.embeddings.float_, st.encode([LONG]))


def test_model_names_are_checked(co: cohere.ClientV2) -> None:
    # a served alias works; another model's name is a 404 (Cohere and vLLM refuse it too)
    assert co.embed(model="embed-v5.0-fast", input_type="search_query", texts=["a"]).id
    with pytest.raises(cohere.errors.NotFoundError):
        co.embed(model="embed-english-v3.0", input_type="search_query", texts=["a"])


@pytest.mark.parametrize(
    ("change", "param"),
    [
        ({"priority": 1000}, "priority"),
        ({"priority": -1}, "priority"),
        ({"embedding_types": ["int4"]}, "embedding_types"),
        ({"input_type": "poem"}, "input_type"),
        ({"truncate": "MIDDLE"}, "truncate"),
        ({"max_tokens": 2}, "max_tokens"),  # no more than MiniLM's [CLS] and [SEP]
        ({"max_tokens": 0}, "max_tokens"),
        ({"output_dimension": 1024}, "dimensions"),  # MiniLM declares no Matryoshka sizes
        ({"texts": []}, "texts"),
        ({"texts": ["a", ""]}, "texts"),
        ({"texts": "hello"}, "texts"),
        ({"texts": None, "inputs": [{"content": []}]}, "inputs"),
        ({"texts": None, "inputs": [{"content": [{"type": "text"}]}]}, "inputs"),
        (
            {
                "texts": None,
                "inputs": [{"content": [{"type": "image_url", "image_url": {"url": "x"}}]}],
            },
            "inputs",
        ),
    ],
)
def test_bad_input_is_a_clear_400(server: TestClient, change: dict[str, Any], param: str) -> None:
    body = {k: v for k, v in {**TEXTS_EXAMPLE, **change}.items() if v is not None}
    response = server.post("/v2/embed", json=body)
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == param


def test_output_dimension_on_a_matryoshka_model(st: SentenceTransformer) -> None:
    overrides = json.dumps({"is_matryoshka": True})
    settings = ServerSettings(model=None, served_model_name=NAMES, hf_overrides=overrides)
    with TestClient(create_app(settings)) as client:
        co = cohere.ClientV2(base_url=str(client.base_url), api_key="k", httpx_client=client)
        got = co.embed(
            texts=["hello"], model="embed-v4.0", input_type="classification", output_dimension=128
        )
    # as vLLM: the first 128 dimensions, normalized again (sentence-transformers' truncate_dim)
    assert_close(
        got.embeddings.float_, st.encode(["hello"], truncate_dim=128, normalize_embeddings=True)
    )


def test_truncate_none_refuses_even_under_auto_truncate(
    tiny_model_dir: Callable[[str], Path],
) -> None:
    # Cohere's NONE: an input above the model's length is an error, whatever the server's default
    longer = " ".join(f"word{i}" for i in range(1200))  # beyond the tiny BERT's 512 positions
    directory = str(tiny_model_dir("bert"))
    settings = ServerSettings(model=directory, served_model_name=["bert"], auto_truncate=True)
    with TestClient(create_app(settings)) as client:
        co = cohere.ClientV2(base_url=str(client.base_url), api_key="k", httpx_client=client)
        cut = co.embed(model="bert", input_type="search_query", texts=[longer], truncate="END")
        assert cut.meta is not None and cut.meta.tokens is not None
        assert cut.meta.tokens.input_tokens == 512
        with pytest.raises(cohere.errors.BadRequestError) as refused:
            co.embed(model="bert", input_type="search_query", texts=[longer], truncate="NONE")
    assert refused.value.body["error"]["code"] == "context_length_exceeded"
