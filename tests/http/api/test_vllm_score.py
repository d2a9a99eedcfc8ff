"""vLLM 0.33's `/score` HTTP tests, ported.

The same requests and assertions as the /score, /tokenize, /pooling and /invocations cases of
vLLM's tests/entrypoints/pooling/scoring/test_bi_encoder_online.py (read at vllm-project/vllm
2119286), scoring/test_cross_encoder_online.py (29fda79), scoring/test_online_score.py (5860224)
and scoring/test_late_interaction_online.py (41c5903); their /rerank cases are in
test_vllm_rerank.py. vLLM's models are replaced by checkpoints of the same kind, their scores
computed by the same references:

- cross-encoder (bge-reranker-base, bge-reranker-v2-m3: XLM-R, one label): the tiny XLM-R
  cross-encoder, against sentence-transformers' CrossEncoder;
- bi-encoder (bge-base-en-v1.5): the bundled all-MiniLM-L6-v2, against the cosine of
  sentence-transformers' embeddings;
- late interaction (answerai-colbert-small-v1, an HF_ColBERT): a tiny HF_ColBERT, against
  transformers' BERT, its projection and MaxSim (vLLM's ColBERTScoringHfRunner).

All at vLLM's `--max-model-len 100` (512 for ColBERT). Where this server answers differently on
purpose, the case asserts this server's answer and says why (docs/api.md lists each difference).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from transformers import AutoTokenizer

from tests.http.api.vllm_checks import Served
from tests.http.serving import start_together

INPUT_TEXT = "This product was excellent and exceeded my expectations"
TEXTS_1 = ["What is the capital of France?", "What is the capital of Germany?"]
TEXTS_2 = ["The capital of France is Paris.", "The capital of Germany is Berlin."]
QUERY = "What is the capital of France?"
DOCUMENTS = ["The capital of Brazil is Brasilia.", "The capital of France is Paris."]
TOO_LONG = "Please reduce the length of the input prompt"
SMALLER = "Please request a smaller truncation size."


Scorer = Served  # the shared fixtures' record (conftest.py)


@pytest.fixture(scope="module", autouse=True)
def _servers(request: pytest.FixtureRequest) -> None:
    start_together(request, ("cross", "bi", "colbert"))


@pytest.fixture(params=["cross", "bi"])
def scorer(request: pytest.FixtureRequest) -> Scorer:
    """vLLM's test_online_score.py runs each case on a cross-encoder and a bi-encoder."""
    found: Scorer = request.getfixturevalue(request.param)
    return found


def _score(scorer: Scorer, path: str = "/score", /, **body: Any) -> dict[str, Any]:
    response = scorer.client.post(path, json={"model": scorer.name, **body})
    assert response.status_code == 200, response.text
    return dict(response.json())


def _check(scorer: Scorer, body: dict[str, Any], pairs: list[list[str]]) -> None:
    """vLLM's checks of a score answer: an id, one item per pair, each score as the reference's
    (vLLM: within 1%; here float32's tolerance)."""
    answer = _score(scorer, **body)
    assert answer["id"] is not None
    assert len(answer["data"]) == len(pairs)
    got = [item["score"] for item in answer["data"]]
    np.testing.assert_allclose(got, scorer.predict(pairs), rtol=1e-4, atol=1e-6)


N_TO_N = [[query, document] for query, document in zip(TEXTS_1, TEXTS_2, strict=True)]
# Every form of vLLM's ScoreRequest: (body, the pairs it means).
FORMS: dict[str, tuple[dict[str, Any], list[list[str]]]] = {
    "queries_str_documents_str": (
        {"queries": QUERY, "documents": TEXTS_2[0]},
        [[QUERY, TEXTS_2[0]]],
    ),
    "queries_str_items_str": ({"queries": QUERY, "items": TEXTS_2[0]}, [[QUERY, TEXTS_2[0]]]),
    "text_1_str_text_2_str": ({"text_1": QUERY, "text_2": TEXTS_2[0]}, [[QUERY, TEXTS_2[0]]]),
    "data_1_str_data_2_str": ({"data_1": QUERY, "data_2": TEXTS_2[0]}, [[QUERY, TEXTS_2[0]]]),
    "queries_str_documents_list": (
        {"queries": QUERY, "documents": DOCUMENTS},
        [[QUERY, DOCUMENTS[0]], [QUERY, DOCUMENTS[1]]],
    ),
    "queries_str_documents_n": (
        {"queries": TEXTS_1[0], "documents": TEXTS_2},
        [[TEXTS_1[0], TEXTS_2[0]], [TEXTS_1[0], TEXTS_2[1]]],
    ),
    "queries_vs_documents": ({"queries": TEXTS_1, "documents": TEXTS_2}, N_TO_N),
    "queries_vs_items": ({"queries": TEXTS_1, "items": TEXTS_2}, N_TO_N),
    "text_1_vs_text_2": ({"text_1": TEXTS_1, "text_2": TEXTS_2}, N_TO_N),
    "data_1_vs_data_2": ({"data_1": TEXTS_1, "data_2": TEXTS_2}, N_TO_N),
    "queries_list_documents_list": (
        {"queries": ["What is the capital of the United States?", QUERY], "documents": DOCUMENTS},
        [["What is the capital of the United States?", DOCUMENTS[0]], [QUERY, DOCUMENTS[1]]],
    ),
}


@pytest.mark.parametrize("form", FORMS)
def test_score_forms(scorer: Scorer, form: str) -> None:
    """vLLM's test_score_api_* (bi-encoder and cross-encoder files) and TestModel's
    test_queries_* / test_text_1_* / test_data_1_* cases: 1:1, 1:N and N:N in each form."""
    body, pairs = FORMS[form]
    _check(scorer, body, pairs)


def test_cross_encoder_basic(cross: Scorer, cross_dir: Path) -> None:
    """vLLM's cross-encoder test_basic: /v1/models names the model; /tokenize gives the
    tokenizer's ids (vLLM pins bge-reranker-base's)."""
    assert cross.client.get("/v1/models").json()["data"][0]["id"] == cross.name
    tokens = cross.client.post("/tokenize", json={"model": cross.name, "prompt": INPUT_TEXT})
    want = AutoTokenizer.from_pretrained(str(cross_dir))(INPUT_TEXT)["input_ids"]
    assert tokens.json()["tokens"] == want


def _max_model_len_cases(scorer: Scorer) -> tuple[Any, Any]:
    queries = QUERY * 20
    body = {"model": scorer.name, "queries": queries, "documents": DOCUMENTS}
    plain = scorer.client.post("/score", json=body)
    cut = scorer.client.post("/score", json={**body, "truncate_prompt_tokens": 101})
    assert cut.status_code == 400
    assert SMALLER in cut.json()["error"]["message"]
    return plain, cut


def test_cross_encoder_score_max_model_len(cross: Scorer) -> None:
    """vLLM's test_score_api_max_model_len (cross-encoder): a pair above the model's 100 tokens
    is a 400 saying to shorten it; a truncation above max_model_len asks for a smaller one."""
    plain, _ = _max_model_len_cases(cross)
    assert plain.status_code == 400
    assert TOO_LONG in plain.json()["error"]["message"]
    assert plain.json()["error"]["code"] == "context_length_exceeded"


def test_bi_encoder_score_max_model_len(bi: Scorer, minilm_dir: Path) -> None:
    """vLLM's test_score_api_max_model_len (bi-encoder). Difference kept: a sentence-
    transformers model cuts every text at its length (here the model's 100 tokens), as
    SentenceTransformer.encode does, where vLLM refuses the long query (docs/api.md, Inputs);
    each pair is then the cut query's embedding against the document's. The truncation above
    max_model_len is refused as in vLLM."""
    plain, _ = _max_model_len_cases(bi)
    assert plain.status_code == 200, plain.text
    # each pair counts its query's 100 tokens, its document's and one pad token (vLLM's count)
    tokenizer = AutoTokenizer.from_pretrained(str(minilm_dir))
    documents = sum(len(tokenizer(d)["input_ids"]) for d in DOCUMENTS)
    assert plain.json()["usage"]["prompt_tokens"] == 2 * (100 + 1) + documents


def test_invocations(scorer: Scorer) -> None:
    """vLLM's TestModel.test_invocations: SageMaker's /invocations answers a score body as
    /score (vLLM: within 5%; here the same numbers)."""
    body = {"queries": QUERY, "documents": TEXTS_2[0]}
    scored = _score(scorer, **body)
    invoked = _score(scorer, "/invocations", **body)
    assert scored.keys() == invoked.keys()
    for ours, theirs in zip(scored["data"], invoked["data"], strict=True):
        assert ours.keys() == theirs.keys()
        assert ours["score"] == pytest.approx(theirs["score"], rel=1e-6)


def _activated(scorer: Scorer, use_activation: bool | None) -> torch.Tensor:
    body = {"queries": QUERY, "documents": TEXTS_2[0], "use_activation": use_activation}
    return torch.tensor([item["score"] for item in _score(scorer, **body)["data"]])


def test_use_activation(scorer: Scorer) -> None:
    """vLLM's TestModel.test_use_activation: a cross-encoder's default is the sigmoid of its
    logit and false gives the logit (checked against CrossEncoder without activation too);
    vLLM asserts nothing for the bi-encoder, whose cosine takes no activation (docs/api.md:
    `use_activation` is ignored there), so the three agree."""
    default, activated, raw = (_activated(scorer, flag) for flag in (None, True, False))
    assert torch.allclose(default, activated, atol=1e-2)
    if scorer.name == "embedder":
        assert torch.allclose(activated, raw)
        return
    assert not torch.allclose(activated, raw, atol=1e-2)
    assert torch.allclose(F.sigmoid(raw), activated, atol=1e-2)
    np.testing.assert_allclose(raw.numpy(), torch.logit(activated.double()).numpy(), rtol=1e-4)


def test_bi_encoder_pooling_embed(bi: Scorer) -> None:
    """vLLM's bi-encoder test_pooling_embed: /pooling with task embed, the model's width."""
    body = {"model": bi.name, "input": INPUT_TEXT, "encoding_format": "float", "task": "embed"}
    data = bi.client.post("/pooling", json=body).json()["data"]
    assert len(data) == 1
    assert len(data[0]["data"]) == 384  # vLLM's bge-base: 768


def _not_supported(scorer: Scorer, task: str) -> dict[str, Any]:
    body = {"model": scorer.name, "input": INPUT_TEXT, "encoding_format": "float", "task": task}
    response = scorer.client.post("/pooling", json=body)
    assert response.status_code == 400
    error: dict[str, Any] = response.json()["error"]
    # vLLM: type "BadRequestError"; this server keeps OpenAI's type (docs/api.md, error body)
    assert error["type"] == "invalid_request_error"
    if task == "plugin":  # no task of this server: the body's schema refuses it
        assert error["param"] == "task", error
    else:
        assert error["message"].startswith(f"Unsupported task: {task!r}"), error
    return error


@pytest.mark.parametrize("task", ["classify", "token_classify", "plugin"])
def test_bi_encoder_pooling_not_supported(bi: Scorer, task: str) -> None:
    """vLLM's bi-encoder test_pooling_not_supported."""
    _not_supported(bi, task)


# scoring/test_late_interaction_online.py


@pytest.mark.parametrize(
    "form", ["queries_str_documents_str", "queries_str_documents_n", "queries_vs_documents"]
)
def test_late_interaction_score(colbert: Scorer, form: str) -> None:
    """vLLM's late-interaction test_score_api_*: MaxSim as transformers computes it. vLLM runs
    them twice, with MaxSim on the GPU worker and without; here MaxSim has one place."""
    body, pairs = FORMS[form]
    _check(colbert, body, pairs)


def test_late_interaction_token_embed(colbert: Scorer) -> None:
    """vLLM's test_token_embed: /pooling token_embed, one projected vector per token."""
    body = {"model": colbert.name, "input": QUERY, "task": "token_embed"}
    data = colbert.client.post("/pooling", json=body).json()["data"]
    assert len(data) == 1
    assert len(data[0]["data"]) > 0
    assert len(data[0]["data"][0]) == 8  # the tiny projection's width (vLLM's model: 96)


def test_late_interaction_embed_not_supported(colbert: Scorer) -> None:
    """vLLM's test_embed_not_supported: a ColBERT model serves token_embed only."""
    _not_supported(colbert, "embed")
