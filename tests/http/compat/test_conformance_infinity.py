"""Infinity's `/embeddings`, `/rerank` and `/models` on the wire, against Infinity's own shapes.

Examples replayed from the route descriptions of Infinity 0.0.77 (michaelfeil/infinity fcb951c,
`infinity_server.py`, published in its OpenAPI document); rerank bodies as its generated client
sends them (`raw_scores`, `return_documents` and `model` always). Answers are checked field by
field against the shapes of its `fastapi_schemas/pymodels.py` as its FastAPI writes them (every
field, nothing else), and against those pydantic models themselves where `infinity_emb` is
installed; values against sentence-transformers.
"""

from __future__ import annotations

import base64
import json
import shutil
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, Literal

import numpy as np
import openai
import pytest
import torch
from pydantic import BaseModel, ConfigDict
from sentence_transformers import CrossEncoder, SentenceTransformer
from starlette.testclient import TestClient

from poolserve.config.settings import ServerSettings
from poolserve.http.app import create_app
from tests.http.serving import assert_close, minilm_client
from tests.tiny_models import minilm_path, write_st_modules
from tests.tiny_rerankers import save_cross_encoder

# the route descriptions' examples, unchanged
TEXT_EXAMPLE = {"model": "openai/clip-vit-base-patch32", "input": ["Two cute cats."]}
IMAGE_EXAMPLE = {
    "model": "openai/clip-vit-base-patch32",
    "encoding_format": "base64",
    "input": ["http://images.cocodataset.org/val2017/000000039769.jpg"],
    "modality": "image",
}
BEEP = (
    "https://github.com/michaelfeil/infinity/raw/3b72eb7c14bae06e68ddd07c1f23fe0bf403f220/"
    "libs/infinity_emb/tests/data/audio/beep.wav"
)
OPENAI_TEXTS = ["the sound of a beep", "the sound of a cat"]
RERANK_EXAMPLE = {
    "model": "mixedbread-ai/mxbai-rerank-xsmall-v1",
    "query": "Where is Munich?",
    "documents": ["Munich is in Germany.", "The sky is blue."],
}
CLIENT_DEFAULTS = {"return_documents": False, "raw_scores": False}


class Shape(BaseModel):
    """Every field required and no other: Infinity's response models write all of theirs."""

    model_config = ConfigDict(extra="forbid")


class Usage(Shape):
    prompt_tokens: int
    total_tokens: int


class EmbeddingObject(Shape):
    object: Literal["embedding"]
    embedding: list[float] | str
    index: int


class EmbeddingResult(Shape):
    object: Literal["list"]
    data: list[EmbeddingObject]
    model: str
    usage: Usage
    id: str
    created: int


class RerankObject(Shape):
    relevance_score: float
    index: int
    document: str | None


class RerankResult(Shape):
    object: Literal["rerank"]
    results: list[RerankObject]
    model: str
    usage: Usage
    id: str
    created: int


class ModelInfo(Shape):
    id: str
    stats: dict[str, Any]
    object: Literal["model"]
    owned_by: Literal["infinity"]
    created: int
    backend: str
    capabilities: list[str]


class ModelList(Shape):
    data: list[ModelInfo]
    object: str


@pytest.fixture(scope="module", params=["app", "live"])
def client(request: pytest.FixtureRequest) -> Iterator[Any]:
    """MiniLM behind the in-process app and behind a real server process."""
    with minilm_client(request.param, lambda: request.getfixturevalue("live_minilm")) as c:
        yield c


@pytest.fixture(scope="module")
def st() -> SentenceTransformer:
    return SentenceTransformer(str(minilm_path()), device="cpu")


@pytest.fixture(scope="module")
def cross_encoder_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_cross_encoder("bert_cls", tmp_path_factory.mktemp("infinity_ce"))


def _ok(client: TestClient, path: str, body: dict[str, Any], shape: type[Shape]) -> Any:
    response = client.post(path, json=body)
    assert response.status_code == 200, response.text
    return shape.model_validate(response.json())


def _tokens(st: SentenceTransformer, texts: list[str]) -> int:
    return sum(len(st.tokenizer(text)["input_ids"]) for text in texts)


def test_text_example_under_any_model_name(client: TestClient, st: SentenceTransformer) -> None:
    # one model served: Infinity answers any `model` with it and reports its own name
    answer = _ok(client, "/embeddings", TEXT_EXAMPLE, EmbeddingResult)
    assert answer.model == "minilm" and answer.id.startswith("infinity-")
    assert [d.index for d in answer.data] == [0]
    assert_close([d.embedding for d in answer.data], st.encode(TEXT_EXAMPLE["input"]))
    tokens = _tokens(st, TEXT_EXAMPLE["input"])
    assert answer.usage == Usage(prompt_tokens=tokens, total_tokens=tokens)


def test_openai_client_example(client: TestClient, st: SentenceTransformer) -> None:
    sdk = openai.OpenAI(base_url=f"{client.base_url}/", api_key="none", http_client=client)
    got = sdk.embeddings.create(
        model="laion/larger_clap_general",
        input=OPENAI_TEXTS,
        encoding_format="base64",  # base64: optional high performance setting
        extra_body={"modality": "text"},
    )
    rows = [np.frombuffer(base64.b64decode(str(d.embedding)), dtype="<f4") for d in got.data]
    assert_close(np.stack(rows), st.encode(OPENAI_TEXTS))
    with pytest.raises(openai.BadRequestError):
        sdk.embeddings.create(
            model="laion/larger_clap_general",
            input=["data:audio/wav;base64,UklGRiQAAABXQVZF"],
            encoding_format="float",
            extra_body={"modality": "audio"},
        )


@pytest.mark.parametrize(
    "body",
    [
        IMAGE_EXAMPLE,
        {"model": "laion/larger_clap_general", "input": [BEEP], "modality": "audio"},
    ],
)
def test_image_and_audio_examples_are_refused(client: TestClient, body: dict[str, Any]) -> None:
    response = client.post("/embeddings", json=body)
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == "modality"


def test_empty_and_blank_texts_embed_the_special_tokens(
    client: TestClient, st: SentenceTransformer
) -> None:
    # Infinity strips texts and embeds "" as the tokenizer gives it: [CLS] [SEP]
    texts = ["", "  \n", "hello world"]
    answer = _ok(client, "/embeddings", {"input": texts}, EmbeddingResult)
    assert [d.index for d in answer.data] == [0, 1, 2]
    assert_close([d.embedding for d in answer.data], st.encode(["", "", "hello world"]))
    assert answer.usage.prompt_tokens == _tokens(st, ["", "", "hello world"])
    alone = _ok(client, "/embeddings", {"input": ""}, EmbeddingResult)
    assert_close(alone.data[0].embedding, st.encode(""))


def test_dimensions_cut_any_model_without_normalizing_again(
    client: TestClient, st: SentenceTransformer
) -> None:
    body = {"input": ["This is a test sentence.", "This is another test sentence."]}
    answer = _ok(client, "/embeddings", {**body, "dimensions": 10}, EmbeddingResult)
    assert_close([d.embedding for d in answer.data], st.encode(body["input"])[:, :10])
    whole = _ok(client, "/embeddings", {**body, "dimensions": 0}, EmbeddingResult)
    assert [len(d.embedding) for d in whole.data] == [384, 384]


def test_no_sentence_transformers_prompt_applies(
    tiny_model_dir: Callable[[str], Path], tmp_path: Path
) -> None:
    # Infinity tokenizes texts as they are: a model's default prompt is not prepended
    directory = tmp_path / "prompted"
    shutil.copytree(tiny_model_dir("bert"), directory)
    write_st_modules(directory, max_seq_length=None, do_lower_case=False)
    config = {"prompts": {"query": "query: "}, "default_prompt_name": "query"}
    (directory / "config_sentence_transformers.json").write_text(json.dumps(config))
    reference = SentenceTransformer(str(directory), device="cpu")
    texts = ["what is the capital of france", ""]
    with TestClient(create_app(ServerSettings(model=str(directory)))) as prompted:
        answer = _ok(prompted, "/embeddings", {"input": texts}, EmbeddingResult)
    assert_close([d.embedding for d in answer.data], reference.encode(texts, prompt=""))


def test_models_is_infinitys_model_info(client: TestClient) -> None:
    response = client.get("/models")
    assert response.status_code == 200, response.text
    listing = ModelList.model_validate(response.json())
    card = listing.data[0]
    assert listing.object == "list" and card.id == "minilm" and card.backend == "torch"
    assert set(card.stats) == {"queue_fraction", "queue_absolute", "results_pending", "batch_size"}
    assert "embed" in card.capabilities


def test_rerank_example_on_a_cross_encoder(cross_encoder_dir: Path) -> None:
    pairs = [(RERANK_EXAMPLE["query"], doc) for doc in RERANK_EXAMPLE["documents"]]
    reference = CrossEncoder(str(cross_encoder_dir), device="cpu")
    logits = reference.predict(pairs, activation_fn=torch.nn.Identity())
    tokens = sum(len(reference.tokenizer(q, d)["input_ids"]) for q, d in pairs)
    settings = ServerSettings(model=str(cross_encoder_dir), served_model_name=["ce"])
    with TestClient(create_app(settings)) as ce:
        scored = _ok(ce, "/rerank", {**RERANK_EXAMPLE, **CLIENT_DEFAULTS}, RerankResult)
        raw = _ok(ce, "/rerank", {**RERANK_EXAMPLE, "raw_scores": True}, RerankResult)
        top = _ok(
            ce,
            "/rerank",
            {**RERANK_EXAMPLE, "raw_scores": False, "return_documents": True, "top_n": 1},
            RerankResult,
        )
    order = list(np.argsort(-logits, kind="stable"))
    assert [r.index for r in scored.results] == order and scored.model == "ce"
    assert all(r.document is None for r in scored.results)
    sigmoid = 1 / (1 + np.exp(-logits))
    assert np.allclose([r.relevance_score for r in scored.results], sigmoid[order], atol=1e-5)
    assert np.allclose([r.relevance_score for r in raw.results], logits[order], atol=1e-4)
    assert scored.usage == Usage(prompt_tokens=tokens, total_tokens=tokens)
    best = order[0]
    assert [(r.index, r.document) for r in top.results] == [
        (best, RERANK_EXAMPLE["documents"][best])
    ]


@pytest.mark.parametrize(
    ("path", "body", "param"),
    [
        ("/embeddings", {"input": []}, "input"),
        ("/embeddings", {"input": 5}, "input"),
        ("/embeddings", {"input": [[101, 102]]}, "input"),
        ("/embeddings", {"model": "m"}, "input"),
        ("/embeddings", {"input": ["a"], "encoding_format": "int8"}, "encoding_format"),
        ("/embeddings", {"input": ["a"], "modality": "video"}, "modality"),
        ("/embeddings", {"input": ["a"], "dimensions": 385}, "dimensions"),
        ("/embeddings", {"input": ["a"], "dimensions": -1}, "dimensions"),
        ("/embeddings", {"input": ["a"], "user": 7}, "user"),
        ("/rerank", {"query": "q", "documents": ["a"], "raw_scores": False, "top_n": 0}, "top_n"),
        ("/rerank", {"query": "q", "documents": [], "raw_scores": False}, "documents"),
        ("/rerank", {"documents": ["a"], "raw_scores": False}, "query"),
        ("/rerank", {"query": "q", "documents": ["a"], "raw_scores": "maybe"}, "raw_scores"),
    ],
)
def test_bad_input_is_a_clear_400(
    client: TestClient, path: str, body: dict[str, Any], param: str
) -> None:
    response = client.post(path, json=body)
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == param


def test_answers_validate_against_infinitys_own_models(client: TestClient) -> None:
    pymodels = pytest.importorskip("infinity_emb.fastapi_schemas.pymodels")
    pairs = (
        (client.post("/embeddings", json=TEXT_EXAMPLE), pymodels.OpenAIEmbeddingResult),
        (client.post("/rerank", json={**RERANK_EXAMPLE, **CLIENT_DEFAULTS}), pymodels.ReRankResult),
        (client.get("/models"), pymodels.OpenAIModelInfo),
    )
    for response, model in pairs:
        answer = response.json()
        assert set(answer) == set(model.model_fields), model.__name__
        model.model_validate(answer)
