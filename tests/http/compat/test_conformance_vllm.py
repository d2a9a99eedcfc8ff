"""vLLM's own request examples replayed unchanged on its routes, answers checked field by field.

Request bodies are the examples of vLLM's documentation (docs/models/pooling_models/scoring.md,
docs/serving/openai_compatible_server.md) and the fields of vLLM 0.33's protocol classes
(`ScoreRequest`'s four forms, `RerankRequest`, `TokenizeCompletionRequest`,
`TokenizeChatRequest`); response shapes are vLLM 0.33's (`ScoreResponse`, `RerankResponse`,
`TokenizeResponse`, `UsageInfo`). References: sentence-transformers' CrossEncoder and
SentenceTransformer, transformers' tokenizer and chat template.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from sentence_transformers import CrossEncoder, SentenceTransformer
from starlette.testclient import TestClient
from transformers import AutoTokenizer

from poolserve.config.settings import ServerSettings
from poolserve.http.app import create_app
from tests.http.serving import minilm_client
from tests.tiny_models import MINILM_DIR
from tests.tiny_rerankers import build_cross_encoder, save_cross_encoder

MAX_MODEL_LEN = 64
# Names the documentation's examples send as `model`; the cross-encoder answers to all of them.
RERANKER_NAMES = ["BAAI/bge-reranker-v2-m3", "BAAI/bge-reranker-base", "ce"]
CLASSIFIER_NAME = "jason9693/Qwen2.5-1.5B-apeach"
# vLLM's UsageInfo of a pooling answer, as its model_dump writes it
USAGE_KEYS = [
    "prompt_tokens",
    "total_tokens",
    "completion_tokens",
    "prompt_tokens_details",
    "completion_tokens_details",
]

SCORE_SINGLE = {
    "model": "BAAI/bge-reranker-v2-m3",
    "encoding_format": "float",
    "queries": "What is the capital of France?",
    "documents": "The capital of France is Paris.",
}
SCORE_BATCH = {
    "model": "BAAI/bge-reranker-v2-m3",
    "queries": "What is the capital of France?",
    "documents": ["The capital of Brazil is Brasilia.", "The capital of France is Paris."],
}
SCORE_ZIP = {
    "model": "BAAI/bge-reranker-v2-m3",
    "encoding_format": "float",
    "queries": ["What is the capital of Brazil?", "What is the capital of France?"],
    "documents": ["The capital of Brazil is Brasilia.", "The capital of France is Paris."],
}
RERANK = {
    "model": "BAAI/bge-reranker-base",
    "query": "What is the capital of France?",
    "documents": [
        "The capital of Brazil is Brasilia.",
        "The capital of France is Paris.",
        "Horses and cows are both animals",
    ],
}
CLASSIFY = {
    "model": CLASSIFIER_NAME,
    "input": ["Loved the new café—coffee was great.", "This update broke everything. Frustrating."],
}
MESSAGES = [
    {"role": "system", "content": "be brief"},
    {"role": "user", "content": "what is pooling"},
]
TEMPLATE = (
    "{% for m in messages %}{{ m['role'] }} : {{ m['content'] }} ; {% endfor %}"
    "{% if add_generation_prompt %}assistant :{% endif %}"
    "{% if topic is defined %} topic {{ topic }}{% endif %}"
)


def _pairs(body: dict[str, Any], first: str, second: str) -> list[tuple[str, str]]:
    """The (query, document) pairs of a vLLM score body: 1:1, 1:N or N:N."""
    firsts, seconds = body[first], body[second]
    firsts = [firsts] if isinstance(firsts, str) else firsts
    seconds = [seconds] if isinstance(seconds, str) else seconds
    return [(firsts[0] if len(firsts) == 1 else firsts[i], d) for i, d in enumerate(seconds)]


def _post(client: TestClient, path: str, body: dict[str, Any]) -> Any:
    response = client.post(path, json=body)
    assert response.status_code == 200, response.text
    return response.json()


def _usage(tokens: int) -> dict[str, Any]:
    return {
        "prompt_tokens": tokens,
        "total_tokens": tokens,
        "completion_tokens": 0,
        "prompt_tokens_details": None,
        "completion_tokens_details": None,
    }


@pytest.fixture(scope="module")
def ce_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_cross_encoder("bert_cls", tmp_path_factory.mktemp("conformance_ce"))


@pytest.fixture(scope="module")
def ce(ce_dir: Path) -> Iterator[TestClient]:
    settings = ServerSettings(
        model=str(ce_dir),
        served_model_name=[*RERANKER_NAMES, CLASSIFIER_NAME],
        max_model_len=MAX_MODEL_LEN,
    )
    with TestClient(create_app(settings)) as client:
        yield client


@pytest.fixture(scope="module")
def cross_encoder(ce_dir: Path) -> CrossEncoder:
    return CrossEncoder(str(ce_dir), device="cpu")


@pytest.fixture(scope="module")
def ce_tokenizer(ce_dir: Path) -> Any:
    return AutoTokenizer.from_pretrained(str(ce_dir))


@pytest.fixture(scope="module", params=["app", "live"])
def minilm(request: pytest.FixtureRequest) -> Iterator[Any]:
    """MiniLM behind the in-process app and behind a real server process."""
    with minilm_client(request.param, lambda: request.getfixturevalue("live_minilm")) as client:
        yield client


@pytest.fixture(scope="module")
def chat(
    tiny_model_dir: Callable[[str], Path], tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[TestClient, Any]]:
    """The tiny llama with a chat template, and its tokenizer."""
    directory = Path(
        shutil.copytree(tiny_model_dir("llama"), tmp_path_factory.mktemp("chat") / "m")
    )
    config_path = directory / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    config["chat_template"] = TEMPLATE
    config_path.write_text(json.dumps(config))
    settings = ServerSettings(
        model=str(directory),
        served_model_name=["chat"],
        max_model_len=MAX_MODEL_LEN,
        trust_request_chat_template=True,
    )
    with TestClient(create_app(settings)) as client:
        yield client, AutoTokenizer.from_pretrained(str(directory))


# ---- /score --------------------------------------------------------------------------------
@pytest.mark.parametrize("path", ["/score", "/v1/score"])
@pytest.mark.parametrize("example", [SCORE_SINGLE, SCORE_BATCH, SCORE_ZIP])
@pytest.mark.parametrize(
    "form",
    [("queries", "documents"), ("queries", "items"), ("data_1", "data_2"), ("text_1", "text_2")],
)
def test_score_examples_equal_cross_encoder(
    ce: TestClient,
    cross_encoder: CrossEncoder,
    ce_tokenizer: Any,
    path: str,
    example: dict[str, Any],
    form: tuple[str, str],
) -> None:
    body = {k: v for k, v in example.items() if k not in ("queries", "documents")}
    body[form[0]], body[form[1]] = example["queries"], example["documents"]
    answer = _post(ce, path, body)
    pairs = _pairs(example, "queries", "documents")
    assert list(answer) == ["id", "object", "created", "model", "data", "usage"]
    assert answer["id"].startswith("score-") and answer["object"] == "list"
    assert isinstance(answer["created"], int) and answer["model"] == RERANKER_NAMES[0]
    want = cross_encoder.predict(pairs)
    assert [list(item) for item in answer["data"]] == [["index", "object", "score"]] * len(pairs)
    assert [item["index"] for item in answer["data"]] == list(range(len(pairs)))
    assert all(item["object"] == "score" for item in answer["data"])
    np.testing.assert_allclose([item["score"] for item in answer["data"]], want, atol=1e-5)
    tokens = sum(len(ce_tokenizer(q, d)["input_ids"]) for q, d in pairs)
    assert list(answer["usage"]) == USAGE_KEYS and answer["usage"] == _usage(tokens)


OTHER = ("horses", "cows")


@pytest.mark.parametrize(
    ("winner", "loser"),
    [
        (("queries", "documents"), ("text_1", "text_2")),
        (("queries", "documents"), ("data_1", "data_2")),
        (("queries", "documents"), ("queries", "items")),
        (("queries", "items"), ("data_1", "data_2")),
        (("data_1", "data_2"), ("text_1", "text_2")),
    ],
)
def test_score_forms_follow_vllms_precedence(
    ce: TestClient, winner: tuple[str, str], loser: tuple[str, str]
) -> None:
    """The first complete form in vLLM's union order wins; the other's fields are ignored."""
    texts = (SCORE_SINGLE["queries"], SCORE_SINGLE["documents"])
    alone = _post(ce, "/score", dict(zip(winner, texts, strict=True)))["data"]
    both = {**dict(zip(loser, OTHER, strict=True)), **dict(zip(winner, texts, strict=True))}
    assert _post(ce, "/score", both)["data"] == alone
    assert _post(ce, "/score", dict(zip(loser, OTHER, strict=True)))["data"] != alone


def test_bi_encoder_score_counts_vllms_usage(minilm: TestClient) -> None:
    answer = _post(minilm, "/score", {**SCORE_BATCH, "model": "minilm"})
    reference = SentenceTransformer(str(MINILM_DIR), device="cpu")
    query = reference.encode(SCORE_BATCH["queries"], convert_to_tensor=True)
    docs = reference.encode(SCORE_BATCH["documents"], convert_to_tensor=True)
    want = torch.nn.functional.cosine_similarity(query[None], docs).numpy()
    np.testing.assert_allclose([d["score"] for d in answer["data"]], want, atol=1e-5)
    # vLLM counts each pair: the query's prompt, one pad token, the document's prompt
    tokenizer = reference.tokenizer
    query_tokens = len(tokenizer(SCORE_BATCH["queries"])["input_ids"])
    tokens = sum(
        query_tokens + 1 + len(tokenizer(d)["input_ids"]) for d in SCORE_BATCH["documents"]
    )
    assert answer["usage"] == _usage(tokens)


# ---- /rerank, /v1/rerank, /v2/rerank ------------------------------------------------------------
@pytest.mark.parametrize("path", ["/rerank", "/v1/rerank", "/v2/rerank"])
@pytest.mark.parametrize("top_n", [None, 0, 2, 99])
def test_rerank_example_equals_cross_encoder(
    ce: TestClient,
    cross_encoder: CrossEncoder,
    ce_tokenizer: Any,
    path: str,
    top_n: int | None,
) -> None:
    body = dict(RERANK) if top_n is None else {**RERANK, "top_n": top_n}
    answer = _post(ce, path, body)
    want = cross_encoder.predict([(RERANK["query"], d) for d in RERANK["documents"]])
    order = np.argsort(-want, kind="stable").tolist()[: top_n or None]
    assert list(answer) == ["id", "model", "usage", "results"]
    # the first served name, as vLLM reports it whatever name the request used
    assert answer["id"].startswith("score-") and answer["model"] == RERANKER_NAMES[0]
    assert [r["index"] for r in answer["results"]] == order
    for result in answer["results"]:
        assert list(result) == ["index", "document", "relevance_score"]
        assert result["document"] == {"text": RERANK["documents"][result["index"]]}
        assert result["relevance_score"] == pytest.approx(want[result["index"]], abs=1e-5)
    tokens = sum(len(ce_tokenizer(RERANK["query"], d)["input_ids"]) for d in RERANK["documents"])
    assert answer["usage"] == {"prompt_tokens": tokens, "total_tokens": tokens}


def test_rerank_takes_one_document_as_a_string(ce: TestClient, cross_encoder: CrossEncoder) -> None:
    answer = _post(ce, "/rerank", {**RERANK, "documents": RERANK["documents"][1]})
    (result,) = answer["results"]
    want = cross_encoder.predict([(RERANK["query"], RERANK["documents"][1])])[0]
    assert result["index"] == 0 and result["relevance_score"] == pytest.approx(want, abs=1e-5)


def _logit(ce_tokenizer: Any, query: str, document: str, max_length: int | None = None) -> float:
    """The cross-encoder's raw logit for the pair cut to max_length, document first."""
    cut = {"truncation": "only_second", "max_length": max_length} if max_length else {}
    encoded = ce_tokenizer(query, document, return_tensors="pt", **cut)
    with torch.no_grad():
        return float(build_cross_encoder("bert_cls")(**encoded).logits[0, 0])


def test_v2_rerank_cuts_long_documents_as_cohere_does(ce: TestClient, ce_tokenizer: Any) -> None:
    long_doc = " ".join(RERANK["documents"] * 20)
    body = {**RERANK, "documents": [long_doc], "use_activation": False}
    # vLLM's routes keep vLLM's rule: a pair longer than the model is refused
    for path in ("/rerank", "/v1/rerank"):
        refused = ce.post(path, json=body)
        assert refused.status_code == 400 and refused.json()["error"]["param"] == "documents"
    (result,) = _post(ce, "/v2/rerank", body)["results"]
    want = _logit(ce_tokenizer, RERANK["query"], long_doc, MAX_MODEL_LEN)
    assert result["relevance_score"] == pytest.approx(want, abs=1e-4)
    # an explicit max_tokens_per_doc keeps each document's first tokens, on every route
    ids = ce_tokenizer(long_doc, add_special_tokens=False)["input_ids"][:7]
    want = _logit(ce_tokenizer, RERANK["query"], ce_tokenizer.decode(ids))
    for path in ("/rerank", "/v2/rerank"):
        (result,) = _post(ce, path, {**body, "max_tokens_per_doc": 7})["results"]
        assert result["relevance_score"] == pytest.approx(want, abs=1e-4)


def test_max_tokens_per_query_keeps_each_querys_first_tokens(
    ce: TestClient, ce_tokenizer: Any
) -> None:
    query = " ".join(RERANK["documents"])  # a long query
    document = RERANK["documents"][0]
    ids = ce_tokenizer(query, add_special_tokens=False)["input_ids"][:5]
    want = _logit(ce_tokenizer, ce_tokenizer.decode(ids), document)
    body = {"query": query, "documents": [document], "use_activation": False}
    for path in ("/rerank", "/v1/rerank"):
        (result,) = _post(ce, path, {**body, "max_tokens_per_query": 5})["results"]
        assert result["relevance_score"] == pytest.approx(want, abs=1e-4), path
    score = {"queries": query, "documents": document, "use_activation": False}
    (item,) = _post(ce, "/score", {**score, "max_tokens_per_query": 5})["data"]
    assert item["score"] == pytest.approx(want, abs=1e-4)


# ---- /tokenize -----------------------------------------------------------------------------
@pytest.mark.parametrize("strings", [None, False, True])
@pytest.mark.parametrize("specials", [None, False])
def test_tokenize_prompt(
    ce: TestClient, ce_tokenizer: Any, strings: bool | None, specials: bool | None
) -> None:
    body: dict[str, Any] = {"model": "ce", "prompt": "Hello, my name is"}
    if strings is not None:
        body["return_token_strs"] = strings
    if specials is not None:
        body["add_special_tokens"] = specials
    answer = _post(ce, "/tokenize", body)
    ids = ce_tokenizer("Hello, my name is", add_special_tokens=specials is None)["input_ids"]
    assert list(answer) == ["count", "max_model_len", "tokens", "token_strs"]
    assert answer["tokens"] == ids and answer["count"] == len(ids)
    assert answer["max_model_len"] == MAX_MODEL_LEN
    assert answer["token_strs"] == (ce_tokenizer.convert_ids_to_tokens(ids) if strings else None)


@pytest.mark.parametrize(
    "options",
    [
        {},
        {"add_generation_prompt": False},
        {"add_generation_prompt": False, "continue_final_message": True},
        {"add_special_tokens": True, "chat_template_kwargs": {"topic": "x"}},
        {"chat_template": "{% for m in messages %}[{{ m['content'] }}]{% endfor %}"},
    ],
)
def test_tokenize_messages(chat: tuple[TestClient, Any], options: dict[str, Any]) -> None:
    client, tokenizer = chat
    body = {"model": "chat", "messages": MESSAGES, "return_token_strs": True, **options}
    answer = _post(client, "/tokenize", body)
    rendered = tokenizer.apply_chat_template(
        MESSAGES,
        chat_template=options.get("chat_template"),
        add_generation_prompt=options.get("add_generation_prompt", True),
        continue_final_message=options.get("continue_final_message", False),
        tokenize=False,
        **options.get("chat_template_kwargs", {}),
    )
    ids = tokenizer(rendered, add_special_tokens=options.get("add_special_tokens", False))
    assert answer["tokens"] == ids["input_ids"] and answer["count"] == len(ids["input_ids"])
    assert answer["token_strs"] == tokenizer.convert_ids_to_tokens(ids["input_ids"])


# ---- usage on embeddings, pooling, classify -----------------------------------------------
def test_embeddings_and_pooling_usage(minilm: TestClient) -> None:
    texts = ["Hello, my name is", "The capital of France is Paris."]
    reference = SentenceTransformer(str(MINILM_DIR), device="cpu")
    tokens = sum(len(reference.tokenizer(t)["input_ids"]) for t in texts)
    body = {"model": "minilm", "input": texts, "encoding_format": "float"}
    embedded = _post(minilm, "/v1/embeddings", body)
    assert list(embedded["usage"]) == USAGE_KEYS and embedded["usage"] == _usage(tokens)
    want = reference.encode(texts)
    got = np.asarray([d["embedding"] for d in embedded["data"]], dtype=np.float32)
    np.testing.assert_allclose(got, want, atol=1e-5)
    assert _post(minilm, "/pooling", {**body, "task": "embed"})["usage"] == _usage(tokens)
    # vLLM's bytes metadata keeps its two counts
    response = minilm.post("/v1/embeddings", json={**body, "encoding_format": "bytes"})
    metadata = json.loads(response.headers["metadata"])
    assert metadata["usage"] == {"prompt_tokens": tokens, "total_tokens": tokens}


def test_classify_example_usage(ce: TestClient, ce_tokenizer: Any, ce_dir: Path) -> None:
    answer = _post(ce, "/classify", CLASSIFY)
    tokens = sum(len(ce_tokenizer(t)["input_ids"]) for t in CLASSIFY["input"])
    assert answer["model"] == RERANKER_NAMES[0] and answer["usage"] == _usage(tokens)
    encoded = ce_tokenizer(CLASSIFY["input"], padding=True, return_tensors="pt")
    with torch.no_grad():
        logits = build_cross_encoder("bert_cls")(**encoded).logits
    want = torch.sigmoid(logits).numpy()
    np.testing.assert_allclose([d["probs"] for d in answer["data"]], want, atol=1e-5)


# ---- bad input: a clear 400 on every changed route ------------------------------------------
@pytest.mark.parametrize(
    ("path", "body", "param"),
    [
        ("/score", {"model": "ce"}, None),
        ("/score", {"queries": "q"}, None),
        ("/score", {"queries": ["a", "b"], "documents": ["c", "d", "e"]}, "documents"),
        ("/v1/score", {"data_1": ["a", "b"], "data_2": "c"}, "data_2"),
        ("/score", {"queries": [], "documents": ["a"]}, "queries"),
        ("/score", {"queries": "q", "documents": [{"content": []}]}, "documents"),
        ("/score", {"queries": "q", "documents": "d", "max_tokens_per_doc": -1}, None),
        ("/rerank", {"query": "q", "documents": ["a"], "top_n": -1}, "top_n"),
        ("/v1/rerank", {"query": "q", "documents": ["a"], "max_tokens_per_doc": 64}, None),
        ("/v2/rerank", {"query": "q", "documents": ["a"], "max_tokens_per_doc": -1}, None),
        ("/v2/rerank", {"query": "q", "documents": []}, "documents"),
        ("/tokenize", {}, None),
        ("/tokenize", {"prompt": "a", "messages": MESSAGES}, None),
        ("/tokenize", {"messages": "hello"}, "messages"),
        ("/tokenize", {"messages": MESSAGES, "continue_final_message": True}, None),
        ("/tokenize", {"messages": MESSAGES, "tools": [{"type": "function"}]}, None),
        ("/tokenize", {"prompt": "a", "return_token_strs": [1]}, "return_token_strs"),
        ("/tokenize", {"messages": MESSAGES}, "messages"),  # this model has no chat template
    ],
)
def test_bad_input_is_a_clear_400(
    ce: TestClient, path: str, body: dict[str, Any], param: str | None
) -> None:
    response = ce.post(path, json=body)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["message"] and error["type"] == "invalid_request_error"
    if param is not None:
        assert error["param"] == param, error


# ---- /v1/embeddings chat forms (vLLM 0.33) ----------------------------------------------------
SECOND = [{"role": "user", "content": "another conversation"}]


def _chat_embedding(client: TestClient, tokenizer: Any, conversation: list[Any]) -> Any:
    """The embedding of the conversation's rendered prompt sent as token ids (no specials)."""
    text = tokenizer.apply_chat_template(conversation, tokenize=False)
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    return _post(client, "/v1/embeddings", {"input": ids})["data"][0]["embedding"]


@pytest.mark.parametrize(
    "body",
    [
        {"input": MESSAGES},
        {"messages": [MESSAGES, SECOND]},
        {"input": [MESSAGES, SECOND]},
    ],
    ids=["one-in-input", "batch-in-messages", "batch-in-input"],
)
def test_embeddings_take_vllms_chat_forms(chat: tuple[TestClient, Any], body: Any) -> None:
    client, tokenizer = chat
    conversations = [body["input"]] if body.get("input") is MESSAGES else next(iter(body.values()))
    got = _post(client, "/v1/embeddings", body)
    assert [item["index"] for item in got["data"]] == list(range(len(conversations)))
    for item, conversation in zip(got["data"], conversations, strict=True):
        want = _chat_embedding(client, tokenizer, conversation)
        np.testing.assert_allclose(item["embedding"], want, atol=1e-6)


def test_a_batch_of_conversations_is_bounded(chat: tuple[TestClient, Any]) -> None:
    client, _ = chat
    limit = client.app.state.poolserve.settings.max_client_batch_size  # type: ignore[attr-defined]
    too_many = client.post("/v1/embeddings", json={"messages": [SECOND] * (limit + 1)})
    assert too_many.status_code == 400, too_many.text
    assert too_many.json()["error"]["param"] == "messages"
    assert "--max-client-batch-size" in too_many.json()["error"]["message"]
    empty = client.post("/v1/embeddings", json={"messages": [SECOND, []]})
    assert empty.status_code == 400, empty.text
