"""/rerank, /v1/rerank, /v2/rerank (vLLM, Jina, Cohere) and TEI's /rerank: shapes, order, bounds."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from sentence_transformers import CrossEncoder
from starlette.testclient import TestClient
from transformers import AutoTokenizer

from poolserve.config.settings import ServerSettings
from poolserve.http.app import create_app
from tests.http.serving import queue_taken
from tests.tiny_rerankers import build_cross_encoder, save_cross_encoder

QUERY = "what is the capital of france"
DOCUMENTS = [
    "the cat sat on the mat",
    "paris is the capital and largest city of france",
    "berlin is the capital of germany, a country next to france",
    "a recipe for bread",
]
# Field names and JSON types of the peers' documented responses.
VLLM_RESULT = {"index": int, "document": dict, "relevance_score": float}  # vLLM's RerankResult
TEI_RANK = {"index": int, "score": float}  # TEI's Rank (text only with return_text)


@pytest.fixture(scope="module")
def directory(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_cross_encoder("bert_cls", tmp_path_factory.mktemp("bert_ce"))


@pytest.fixture(scope="module")
def client(directory: Path) -> Iterator[TestClient]:
    settings = ServerSettings(
        model=str(directory), served_model_name="ce", max_model_len=64, max_client_batch_size=8
    )
    with TestClient(create_app(settings)) as c:
        yield c


@pytest.fixture(scope="module")
def reference(directory: Path) -> np.ndarray:
    """sentence-transformers' scores of (QUERY, document) in input order."""
    scores: np.ndarray = CrossEncoder(str(directory), device="cpu").predict(
        [(QUERY, d) for d in DOCUMENTS]
    )
    return scores


def _post(client: TestClient, path: str, **body: Any) -> Any:
    response = client.post(path, json=body)
    assert response.status_code == 200, response.text
    return response.json()


@pytest.mark.parametrize("path", ["/rerank", "/v1/rerank", "/v2/rerank"])
def test_rerank_shape_matches_vllm_and_jina(
    client: TestClient, reference: np.ndarray, path: str
) -> None:
    answer = _post(client, path, model="ce", query=QUERY, documents=DOCUMENTS)
    # vLLM's RerankResponse: id, model, usage, results (Jina's adds nothing we lack)
    assert list(answer) == ["id", "model", "usage", "results"]
    # vLLM's scoring routes share one id prefix (ServingScores.request_id_prefix)
    assert answer["id"].startswith("score-") and answer["model"] == "ce"
    usage = answer["usage"]
    assert usage["total_tokens"] == usage["prompt_tokens"] > 0
    order = np.argsort(-reference, kind="stable")
    assert [r["index"] for r in answer["results"]] == order.tolist()
    for result in answer["results"]:
        assert {k: type(v) for k, v in result.items()} == VLLM_RESULT
        assert result["document"] == {"text": DOCUMENTS[result["index"]]}
        assert result["relevance_score"] == pytest.approx(reference[result["index"]], abs=1e-5)


def test_top_n_and_return_documents(client: TestClient, reference: np.ndarray) -> None:
    answer = _post(
        client, "/v2/rerank", query=QUERY, documents=DOCUMENTS, top_n=2, return_documents=False
    )
    best = np.argsort(-reference, kind="stable")[:2].tolist()
    assert [r["index"] for r in answer["results"]] == best
    assert all(set(r) == {"index", "relevance_score"} for r in answer["results"])
    # a top_n beyond the documents returns them all
    assert (
        len(_post(client, "/v1/rerank", query=QUERY, documents=DOCUMENTS, top_n=99)["results"]) == 4
    )


def test_use_activation_false_gives_raw_logits(directory: Path, client: TestClient) -> None:
    raw = CrossEncoder(str(directory), device="cpu").predict(
        [(QUERY, d) for d in DOCUMENTS], activation_fn=torch.nn.Identity()
    )
    answer = _post(client, "/rerank", query=QUERY, documents=DOCUMENTS, use_activation=False)
    got = {r["index"]: r["relevance_score"] for r in answer["results"]}
    np.testing.assert_allclose([got[i] for i in range(4)], raw, atol=1e-4)


def test_tei_rerank_shape(directory: Path, client: TestClient, reference: np.ndarray) -> None:
    ranks = _post(client, "/rerank", query=QUERY, texts=DOCUMENTS)
    assert isinstance(ranks, list)
    assert [r["index"] for r in ranks] == np.argsort(-reference, kind="stable").tolist()
    for rank in ranks:
        assert {k: type(v) for k, v in rank.items()} == TEI_RANK
        assert rank["score"] == pytest.approx(reference[rank["index"]], abs=1e-5)
    with_text = _post(client, "/rerank", query=QUERY, texts=DOCUMENTS, return_text=True)
    assert all(list(r) == ["index", "text", "score"] for r in with_text)
    assert all(r["text"] == DOCUMENTS[r["index"]] for r in with_text)
    raw = CrossEncoder(str(directory), device="cpu").predict(
        [(QUERY, d) for d in DOCUMENTS], activation_fn=torch.nn.Identity()
    )
    raw_ranks = _post(client, "/rerank", query=QUERY, texts=DOCUMENTS, raw_scores=True)
    assert all(r["score"] == pytest.approx(raw[r["index"]], abs=1e-4) for r in raw_ranks)


def test_tei_equal_scores_come_out_in_reverse_input_order(client: TestClient) -> None:
    ranks = _post(client, "/rerank", query=QUERY, texts=[DOCUMENTS[0]] * 3)
    assert [r["index"] for r in ranks] == [2, 1, 0]
    results = _post(client, "/rerank", query=QUERY, documents=[DOCUMENTS[0]] * 3)["results"]
    assert [r["index"] for r in results] == [0, 1, 2]


@pytest.mark.parametrize("direction", ["Left", "left", "Right", "right"])
def test_tei_truncate_cuts_long_texts(directory: Path, client: TestClient, direction: str) -> None:
    long_text = " ".join(DOCUMENTS * 10)
    # TEI >= 1.9 truncates unless told not to; then a long pair is TEI's 422
    refused = client.post("/rerank", json={"query": QUERY, "texts": [long_text], "truncate": False})
    assert refused.status_code == 422 and refused.json()["error_type"] == "Validation"
    body = {"query": QUERY, "texts": [long_text], "truncate": True, "raw_scores": True}
    (rank,) = _post(client, "/rerank", **body, truncation_direction=direction)
    tokenizer = AutoTokenizer.from_pretrained(directory)
    tokenizer.truncation_side = direction.lower()
    encoded = tokenizer(
        QUERY, long_text, truncation="only_second", max_length=64, return_tensors="pt"
    )
    with torch.no_grad():
        want = float(build_cross_encoder("bert_cls")(**encoded).logits[0, 0])
    assert rank["score"] == pytest.approx(want, abs=1e-4)


def test_max_tokens_per_doc_cuts_each_document(directory: Path, client: TestClient) -> None:
    tokenizer = AutoTokenizer.from_pretrained(directory)
    long_text = " ".join(DOCUMENTS * 10)
    kept = tokenizer.decode(tokenizer(long_text, add_special_tokens=False)["input_ids"][:5])
    encoded = tokenizer(QUERY, kept, return_tensors="pt")
    with torch.no_grad():
        want = float(build_cross_encoder("bert_cls")(**encoded).logits[0, 0])
    body = {"query": QUERY, "documents": [long_text], "max_tokens_per_doc": 5}
    (result,) = _post(client, "/v2/rerank", **body, use_activation=False)["results"]
    assert result["relevance_score"] == pytest.approx(want, abs=1e-4)


@pytest.mark.parametrize(
    ("path", "body", "param"),
    [
        ("/v1/rerank", {"query": QUERY, "documents": []}, "documents"),
        ("/rerank", {"query": QUERY, "documents": ["a"], "top_n": -1}, "top_n"),
        (
            "/rerank",
            {"query": QUERY, "documents": ["a"], "max_tokens_per_doc": -1},
            "max_tokens_per_doc",
        ),
        ("/rerank", {"query": "", "documents": ["a"]}, "query"),
        ("/rerank", {"documents": ["a"]}, "query"),
        ("/v1/rerank", {"query": QUERY, "documents": ["a"] * 9}, "documents"),
        ("/v1/rerank", {"query": QUERY, "documents": ["a"], "model": "other"}, "model"),
    ],
)
def test_refusals_name_the_field(
    client: TestClient, path: str, body: dict[str, object], param: str
) -> None:
    response = client.post(path, json=body)
    assert response.status_code in (400, 404), response.text
    assert response.json()["error"]["param"] == param


def test_a_body_that_is_not_an_object_is_refused(client: TestClient) -> None:
    for content in (b"[1, 2]", b"not json", b'{"query": "a", "query": "b", "texts": ["c"]}'):
        response = client.post(
            "/rerank", content=content, headers={"content-type": "application/json"}
        )
        assert response.status_code == 400, content


def test_a_lone_surrogate_is_refused(client: TestClient) -> None:
    content = b'{"query": "q", "documents": ["ok", "bad \\ud800"]}'
    response = client.post("/rerank", content=content, headers={"content-type": "application/json"})
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == "documents"
    assert "1" in response.json()["error"]["message"]


@pytest.mark.parametrize(
    ("body", "status", "error_type"),
    [
        ({"query": QUERY, "texts": []}, 400, "Empty"),
        ({"query": QUERY, "texts": ["a"], "truncation_direction": "up"}, 422, "Validation"),
        ('{"query": "q", "texts": ["ok", "bad \\ud800"]}', 422, "Validation"),
    ],
)
def test_tei_bodies_on_the_shared_path_are_refused_in_tei_shape(
    client: TestClient, body: dict[str, object] | str, status: int, error_type: str
) -> None:
    # a lone surrogate can only be sent as JSON text: Python cannot encode it as UTF-8
    sent = {"content": body} if isinstance(body, str) else {"json": body}
    response = client.post("/rerank", headers={"content-type": "application/json"}, **sent)
    assert response.status_code == status, response.text
    assert set(response.json()) == {"error", "error_type"}
    assert response.json()["error_type"] == error_type


def test_long_text_without_truncation_is_refused_before_tokenization(directory: Path) -> None:
    settings = ServerSettings(model=str(directory), max_input_chars=100, max_request_chars=250)
    with TestClient(create_app(settings)) as small:
        too_long = small.post("/rerank", json={"query": QUERY, "documents": ["x" * 101]})
        assert too_long.status_code == 400
        assert too_long.json()["error"] == {
            "message": too_long.json()["error"]["message"],
            "type": "invalid_request_error",
            "param": "documents",
            "code": "context_length_exceeded",
        }
        # truncation bounds what is read; the request's texts still count against its limit
        body = {"query": QUERY, "documents": ["word " * 40] * 3, "truncate_prompt_tokens": 16}
        assert small.post("/rerank", json=body).status_code == 413


def test_a_rerank_is_one_admission(client: TestClient, monkeypatch: pytest.MonkeyPatch) -> None:
    engine = client.app.state.poolserve.engine  # type: ignore[attr-defined]
    calls: list[int] = []
    submit_many = engine.submit_many

    async def counted(prompts: Any, *args: Any) -> Any:
        calls.append(len(prompts))
        return await submit_many(prompts, *args)

    monkeypatch.setattr(engine, "submit_many", counted)
    _post(client, "/v1/rerank", query=QUERY, documents=DOCUMENTS)
    assert calls == [len(DOCUMENTS)]
    # with room for fewer than all the documents, none is admitted: 429 before tokenizing
    admission = engine.admission
    room = admission.max_num_queued_requests - len(DOCUMENTS) + 1
    with queue_taken(client, room, 1):
        response = client.post("/v1/rerank", json={"query": QUERY, "documents": DOCUMENTS})
    assert response.status_code == 429 and "retry-after" in response.headers
    assert calls == [len(DOCUMENTS)] and admission.queued_requests == 0


@pytest.mark.parametrize("cap", [0, -1])
@pytest.mark.parametrize("path", ["/rerank", "/v1/rerank", "/score"])
def test_max_tokens_per_doc_must_be_positive(client: TestClient, cap: int, path: str) -> None:
    # vLLM's test: 0 and negatives answer 400 with its sentence
    body: dict[str, object] = {"max_tokens_per_doc": cap}
    body |= {"text_1": QUERY, "text_2": ["a"]} if path == "/score" else {}
    body |= {} if path == "/score" else {"query": QUERY, "documents": ["a"]}
    response = client.post(path, json=body)
    assert response.status_code == 400, response.text
    assert "max_tokens_per_doc must be a positive integer" in response.json()["error"]["message"]
