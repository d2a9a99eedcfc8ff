"""The client libraries people already run, against a real `poolserve serve` on the default model.

Each answer is compared with sentence-transformers on the same texts (cosine >= 0.9999); the
Cohere quantised types with sentence-transformers' `quantize_embeddings` of its own floats.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import cohere
import httpx
import numpy as np
import openai
import pytest
import voyageai
import voyageai.error
from langchain_openai import OpenAIEmbeddings
from sentence_transformers import SentenceTransformer, quantize_embeddings

from poolserve.types.model import DEFAULT_MODEL_ID
from tests.deploy.live import LiveProcess, poolserve_server
from tests.tiny_models import MINILM_DIR

pytestmark = pytest.mark.slow
TEXTS = [
    "the cat sat on the mat",
    "poolserve serves pooled outputs of language models",
    "Which city is the capital of France? Paris, on the Seine.",
]
MIN_COSINE = 0.9999
# Components this close to a rounding edge may fall either way between two float32 runs.
SIGN_MARGIN = 1e-4  # of the float, for the sign bit
LEVEL_MARGIN = 0.01  # of one 8-bit level (about 8e-5 of the float)


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveProcess]:
    with poolserve_server(tmp_path_factory.mktemp("clients")) as live:
        yield live


@pytest.fixture(scope="module")
def reference() -> np.ndarray:
    """sentence-transformers' embeddings of TEXTS."""
    model = SentenceTransformer(str(MINILM_DIR), device="cpu")
    return np.asarray(model.encode(TEXTS, convert_to_numpy=True), dtype=np.float32)


class Recorder:
    """An httpx client whose requests' JSON bodies are kept, to see what a library sends."""

    def __init__(self) -> None:
        self.bodies: list[dict[str, Any]] = []
        self.client = httpx.Client(event_hooks={"request": [self._keep]})

    def _keep(self, request: httpx.Request) -> None:
        self.bodies.append(json.loads(request.content))


def assert_cosine(got: Any, want: np.ndarray) -> None:
    vectors = np.asarray(got, dtype=np.float64)
    assert vectors.shape == want.shape, (vectors.shape, want.shape)
    cosine = np.sum(vectors * want, 1) / (
        np.linalg.norm(vectors, axis=1) * np.linalg.norm(want, axis=1)
    )
    assert float(cosine.min()) >= MIN_COSINE, cosine


def test_openai_default_base64_and_explicit_float(server: LiveProcess, reference: Any) -> None:
    recorder = Recorder()
    client = openai.OpenAI(
        base_url=f"{server.base_url}/v1", api_key="unused", http_client=recorder.client
    )
    default = client.embeddings.create(model=DEFAULT_MODEL_ID, input=TEXTS)
    floats = client.embeddings.create(model=DEFAULT_MODEL_ID, input=TEXTS, encoding_format="float")
    assert [b.get("encoding_format") for b in recorder.bodies] == ["base64", "float"]
    assert_cosine([d.embedding for d in default.data], reference)
    assert_cosine([d.embedding for d in floats.data], reference)


def test_langchain_openai_embeddings(server: LiveProcess, reference: Any) -> None:
    recorder = Recorder()
    # the default check_embedding_ctx_length=True sends tiktoken's cl100k token ids, which mean
    # nothing to another tokenizer (and need tiktoken's files): OpenAI-compatible servers set False
    embeddings = OpenAIEmbeddings(
        model=DEFAULT_MODEL_ID,
        base_url=f"{server.base_url}/v1",
        api_key="unused",  # type: ignore[arg-type]
        check_embedding_ctx_length=False,
        http_client=recorder.client,
    )
    documents = embeddings.embed_documents(TEXTS)
    query = embeddings.embed_query(TEXTS[0])
    assert [b["input"] for b in recorder.bodies] == [TEXTS, [TEXTS[0]]]
    assert {b["encoding_format"] for b in recorder.bodies} == {"base64"}
    assert_cosine(documents, reference)
    assert_cosine([query], reference[:1])


def test_cohere_v2_embed_float(server: LiveProcess, reference: Any) -> None:
    client = cohere.ClientV2(base_url=server.base_url, api_key="unused")
    answer = client.embed(
        model=DEFAULT_MODEL_ID, texts=TEXTS, input_type="search_document", embedding_types=["float"]
    )
    assert answer.response_type == "embeddings_by_type" and answer.texts == TEXTS
    assert answer.meta is not None and answer.meta.billed_units is not None
    assert answer.meta.billed_units.input_tokens is not None
    assert answer.meta.billed_units.input_tokens > 0
    assert_cosine(answer.embeddings.float_, reference)


def test_cohere_v2_embed_quantised_types(server: LiveProcess, reference: Any) -> None:
    client = cohere.ClientV2(base_url=server.base_url, api_key="unused")
    kinds = ["int8", "uint8", "binary", "ubinary"]
    answer = client.embed(
        model=DEFAULT_MODEL_ID, texts=TEXTS, input_type="search_query", embedding_types=kinds
    )
    for kind in kinds:
        assert_quantized(np.asarray(getattr(answer.embeddings, kind)), reference, kind)


def assert_quantized(got: np.ndarray, reference: np.ndarray, kind: str) -> None:
    """`got` equals sentence-transformers' quantization of the reference floats over the
    documented range [-1, 1], wherever a component is clear of a rounding edge."""
    dim = reference.shape[1]
    ranges = np.array([[-1.0] * dim, [1.0] * dim], dtype=np.float32)  # the documented range
    level = (reference.astype(np.float64) + 1.0) / (2.0 / 255)  # 8-bit level before flooring
    want = quantize_embeddings(reference, precision=kind, ranges=ranges)  # type: ignore[arg-type]
    assert got.shape == want.shape, kind
    if kind.endswith("binary"):
        # compare bit by bit wherever the sign is clear of float noise
        clear = np.abs(reference) > SIGN_MARGIN
        assert np.array_equal(_bits(got, kind, dim)[clear], _bits(want, kind, dim)[clear])
    else:
        clear = np.abs(level - np.round(level)) > LEVEL_MARGIN
        assert np.array_equal(got[clear], want[clear]), kind
        assert int(np.abs(got.astype(np.int16) - want.astype(np.int16)).max()) <= 1, kind


def _bits(packed: np.ndarray, kind: str, dim: int) -> np.ndarray:
    """The unpacked bits of a binary (offset by -128) or ubinary embedding."""
    unsigned = packed.astype(np.int16) + (128 if kind == "binary" else 0)
    return np.unpackbits(unsigned.astype(np.uint8), axis=1)[:, :dim]


def test_cohere_refusals_raise_the_sdks_errors(server: LiveProcess) -> None:
    client = cohere.ClientV2(base_url=server.base_url, api_key="unused")
    with pytest.raises(cohere.errors.BadRequestError):
        client.embed(
            model=DEFAULT_MODEL_ID, input_type="image", images=["data:image/png;base64,AAAA"]
        )
    with pytest.raises(cohere.errors.NotFoundError):
        client.embed(model="embed-v4.0", texts=TEXTS, input_type="search_query")


def test_voyage_client_embeds_and_quantizes(server: LiveProcess, reference: Any) -> None:
    # voyageai's own client: base64 on the wire, decoded by output_dtype; input_type on a model
    # without prompts embeds as it is (a model with prompts: tests/frontend/test_prompts.py)
    client = voyageai.Client(api_key="unused", base_url=f"{server.base_url}/v1", max_retries=0)
    floats = client.embed(TEXTS, model=DEFAULT_MODEL_ID, input_type="document")
    assert floats.total_tokens > 0
    assert_cosine(floats.embeddings, reference)
    for kind in ("int8", "uint8", "binary", "ubinary"):
        answer = client.embed(TEXTS, model=DEFAULT_MODEL_ID, input_type="query", output_dtype=kind)
        assert_quantized(np.asarray(answer.embeddings), reference, kind)
    # over-long with truncation off: refused, in Voyage's error body ({"detail"}), which its
    # client raises as its own InvalidRequestError with the server's words
    with pytest.raises(voyageai.error.InvalidRequestError, match="more than 256 tokens"):
        client.embed([" ".join(["word"] * 400)], model=DEFAULT_MODEL_ID, truncation=False)
    # a body off the schema is refused before it is known to be Voyage's: OpenAI's body, which
    # the client raises as its generic APIError, status and body included
    with pytest.raises(voyageai.error.APIError, match="output_dtype"):
        client.embed(TEXTS, model=DEFAULT_MODEL_ID, output_dtype="int4")


def test_nim_fields_through_the_openai_client(server: LiveProcess, reference: Any) -> None:
    # NIM's documented call: the OpenAI client with input_type and truncate in extra_body
    client = openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="unused")
    nim = {"input_type": "passage", "truncate": "END"}
    answer = client.embeddings.create(model=DEFAULT_MODEL_ID, input=TEXTS, extra_body=nim)
    assert_cosine([d.embedding for d in answer.data], reference)
    with pytest.raises(openai.BadRequestError):
        client.embeddings.create(
            model=DEFAULT_MODEL_ID,
            input=[" ".join(["word"] * 400)],
            extra_body={"input_type": "query", "truncate": "NONE"},
        )
