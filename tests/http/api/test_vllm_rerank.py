"""vLLM 0.33's `/rerank` HTTP tests, ported.

The same requests and assertions as the /rerank, /pooling and /invocations cases of vLLM's
tests/entrypoints/pooling/scoring/test_cross_encoder_online.py (read at vllm-project/vllm
29fda79; its older copy score/test_online_rerank.py, 11e16f4, asks nothing more),
scoring/test_bi_encoder_online.py (2119286), scoring/test_late_interaction_online.py (41c5903),
scoring/test_max_tokens_per_doc.py (29fda79) and scoring/test_qwen3_reranker_online.py
(630b628); their /score cases are in test_vllm_score.py. vLLM's models are replaced by
checkpoints of the same kind, their scores computed by the same references:

- cross-encoder (bge-reranker-base; jina-reranker-v2, also XLM-R): the tiny XLM-R cross-encoder,
  against sentence-transformers' CrossEncoder;
- bi-encoder (bge-base-en-v1.5): the bundled all-MiniLM-L6-v2, against the cosine of
  sentence-transformers' embeddings;
- late interaction (answerai-colbert-small-v1): a tiny HF_ColBERT, against transformers and
  MaxSim;
- LLM rerankers (Qwen3-Reranker-0.6B, bge-reranker-v2-gemma, read through vLLM's
  `--hf-overrides`): tiny Qwen3 and Gemma causal LMs named as those checkpoints, so the model
  cards' prompts apply as vLLM's `--chat-template` files apply them there.

vLLM's thresholds that only a trained reranker meets (the right document above 0.9, the wrong
one below 0.01) become the reference's own scores and order. Where this server answers
differently on purpose, the case asserts this server's answer and says why (docs/api.md lists
each difference).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from transformers import AutoTokenizer

from tests.http.api.test_score_templates import _qwen_like, qwen3_card
from tests.http.api.vllm_checks import Served
from tests.http.serving import LiveServers, start_together
from tests.tiny_decoders import save_tiny_decoder
from tests.tiny_models import MINILM_DIR, build_hf_model
from tests.tiny_rerankers import QWEN3_YES_NO, build_cross_encoder

INPUT_TEXT = "This product was excellent and exceeded my expectations"
QUERY = "What is the capital of France?"
DOCUMENTS = ["The capital of Brazil is Brasilia.", "The capital of France is Paris."]
THREE = [*DOCUMENTS, "Cross-encoder models are neat"]
TOO_LONG = "Please reduce the length of the input prompt"
GEMMA_YES = {
    "architectures": ["GemmaForSequenceClassification"],
    # vLLM's ["Yes"]: the tiny checkpoints' (MiniLM's lower-cased) vocabulary has only "yes"
    "classifier_from_token": ["yes"],
    "method": "no_post_processing",
}


Reranker = Served  # the shared fixtures' record (conftest.py)


@pytest.fixture(scope="module", autouse=True)
def _servers(request: pytest.FixtureRequest) -> None:
    start_together(request, ("cross", "bi", "colbert", "qwen3", "gemma"))


@pytest.fixture(params=["cross", "bi", "colbert"])
def reranker(request: pytest.FixtureRequest) -> Reranker:
    """The rerank cases vLLM runs on each kind of scorer."""
    found: Reranker = request.getfixturevalue(request.param)
    return found


def _rerank(reranker: Reranker, path: str = "/rerank", /, **body: Any) -> dict[str, Any]:
    response = reranker.client.post(path, json={"model": reranker.name, **body})
    assert response.status_code == 200, response.text
    return dict(response.json())


def test_rerank_texts(reranker: Reranker) -> None:
    """vLLM's test_rerank_api_texts (each kind): two results, best first, each the reference's
    score (vLLM: above 0.9 and below 0.01 for its trained cross-encoder; Paris above Brasilia
    for the others, which the real MiniLM shows too)."""
    answer = _rerank(reranker, query=QUERY, documents=DOCUMENTS)
    assert answer["id"] is not None
    results = answer["results"]
    assert len(results) == 2
    want = reranker.predict([[QUERY, d] for d in DOCUMENTS])
    assert [r["index"] for r in results] == sorted(range(2), key=lambda i: -want[i])
    got = [r["relevance_score"] for r in results]
    np.testing.assert_allclose(got, [want[r["index"]] for r in results], rtol=1e-4, atol=1e-6)
    if reranker.name == "embedder":
        assert results[0]["index"] == 1  # Paris


def test_rerank_top_n(reranker: Reranker) -> None:
    """vLLM's test_rerank_api_top_n: the best two of three (vLLM: Paris first)."""
    answer = _rerank(reranker, query=QUERY, documents=THREE, top_n=2)
    want = reranker.predict([[QUERY, d] for d in THREE])
    best = sorted(range(3), key=lambda i: -want[i])[:2]
    assert [r["index"] for r in answer["results"]] == best
    if reranker.name == "embedder":
        assert answer["results"][0]["index"] == 1


def test_cross_encoder_rerank_max_model_len(cross: Reranker) -> None:
    """vLLM's test_rerank_api_max_model_len (cross-encoder): a query of 700 tokens is a 400."""
    body = {"model": cross.name, "query": QUERY * 100, "documents": DOCUMENTS}
    response = cross.client.post("/rerank", json=body)
    assert response.status_code == 400
    assert TOO_LONG in response.json()["error"]["message"]


def test_bi_encoder_rerank_max_model_len(bi: Reranker) -> None:
    """vLLM's test_rerank_api_max_model_len (bi-encoder). Difference kept: a sentence-
    transformers model cuts every text at its length, as SentenceTransformer.encode does, where
    vLLM refuses the long query (docs/api.md, Inputs)."""
    answer = _rerank(bi, query=QUERY * 100, documents=DOCUMENTS)
    assert len(answer["results"]) == 2


@pytest.mark.parametrize("kind", ["cross", "bi"])
def test_invocations(request: pytest.FixtureRequest, kind: str) -> None:
    """vLLM's test_invocations (cross-encoder and bi-encoder): SageMaker's /invocations answers
    a rerank body as /rerank (vLLM: within 1%; here the same numbers)."""
    reranker: Reranker = request.getfixturevalue(kind)
    body = {"query": QUERY, "documents": DOCUMENTS}
    ranked = _rerank(reranker, **body)
    invoked = _rerank(reranker, "/invocations", **body)
    assert ranked.keys() == invoked.keys()
    for ours, theirs in zip(ranked["results"], invoked["results"], strict=True):
        assert ours.keys() == theirs.keys()
        assert ours["relevance_score"] == pytest.approx(theirs["relevance_score"], rel=1e-6)


def test_use_activation(cross: Reranker) -> None:
    """vLLM's cross-encoder test_use_activation on /rerank: sigmoid by default; false gives
    the logits (each checked against CrossEncoder's)."""

    def scores(use_activation: bool | None) -> torch.Tensor:
        body = {"query": QUERY, "documents": DOCUMENTS, "use_activation": use_activation}
        results = sorted(_rerank(cross, **body)["results"], key=lambda r: r["index"])
        return torch.tensor([r["relevance_score"] for r in results])

    default, activated, raw = scores(None), scores(True), scores(False)
    assert torch.allclose(default, activated, atol=1e-2)
    assert not torch.allclose(activated, raw, atol=1e-2)
    assert torch.allclose(F.sigmoid(raw), activated, atol=1e-2)
    want = cross.predict([[QUERY, d] for d in DOCUMENTS])
    np.testing.assert_allclose(activated.numpy(), want, rtol=1e-4)


def test_pooling_classify(cross: Reranker, cross_dir: Path) -> None:
    """vLLM's cross-encoder test_pooling_classify: one score per text (here against
    transformers' classifier on the text alone, sigmoid as CrossEncoder applies it)."""
    body = {"model": cross.name, "input": INPUT_TEXT, "encoding_format": "float"}
    data = cross.client.post("/pooling", json={**body, "task": "classify"}).json()["data"]
    assert len(data) == 1
    assert len(data[0]["data"]) == 1
    ids = AutoTokenizer.from_pretrained(str(cross_dir))(INPUT_TEXT, return_tensors="pt")
    with torch.inference_mode():
        logit = build_cross_encoder("xlmroberta_cls")(**ids).logits[0]
    np.testing.assert_allclose(data[0]["data"], torch.sigmoid(logit).numpy(), rtol=1e-4)


def test_pooling_token_classify(cross: Reranker) -> None:
    """vLLM's cross-encoder test_pooling_token_classify: vLLM applies the score head to every
    token. Difference kept: here, as on vLLM 0.33's classify server ("Try switching the model's
    pooling_task"), a sequence classifier runs on every token only when started with
    --pooler-config's pooling_task token_classify (test_vllm_classify.py); started without, it
    refuses token_classify, naming what it serves (docs/api.md, classify)."""
    body = {"model": cross.name, "input": INPUT_TEXT, "encoding_format": "float"}
    response = cross.client.post("/pooling", json={**body, "task": "token_classify"})
    assert response.status_code == 400
    assert response.json()["error"]["message"].startswith("Unsupported task: 'token_classify'")


@pytest.mark.parametrize("task", ["embed", "token_embed", "plugin"])
def test_pooling_not_supported(cross: Reranker, task: str) -> None:
    """vLLM's cross-encoder test_pooling_not_supported. Differences kept (docs/api.md,
    classify): OpenAI's error type; `plugin` refused by the body's schema."""
    body = {"model": cross.name, "input": INPUT_TEXT, "encoding_format": "float", "task": task}
    response = cross.client.post("/pooling", json=body)
    assert response.status_code == 400
    error = response.json()["error"]
    assert error["type"] == "invalid_request_error"
    if task == "plugin":
        assert error["param"] == "task", error
    else:
        assert error["message"].startswith(f"Unsupported task: {task!r}"), error


# max_tokens_per_doc: test_cross_encoder_online.py and test_max_tokens_per_doc.py

LONG_DOC = "The capital of France is Paris. " * 50
FIVE = "The capital of France is Paris. " * 5


def test_rerank_max_tokens_per_doc(cross: Reranker, cross_dir: Path) -> None:
    """vLLM's test_rerank_max_tokens_per_doc: a document of 50 sentences cut to 10 tokens
    scores (here as CrossEncoder scores the document's first 10 tokens)."""
    answer = _rerank(cross, query=QUERY, documents=[LONG_DOC, DOCUMENTS[0]], max_tokens_per_doc=10)
    assert answer["id"] is not None
    assert len(answer["results"]) == 2
    assert answer["usage"]["prompt_tokens"] > 0
    tokenizer = AutoTokenizer.from_pretrained(str(cross_dir))
    ids = tokenizer(LONG_DOC, add_special_tokens=False)["input_ids"][:10]
    want = cross.predict([[QUERY, str(tokenizer.decode(ids))]])[0]
    got = next(r for r in answer["results"] if r["index"] == 0)["relevance_score"]
    assert got == pytest.approx(want, rel=1e-4)


def test_rerank_max_tokens_per_doc_reduces_tokens(cross: Reranker) -> None:
    """vLLM's test_rerank_max_tokens_per_doc_reduces_tokens: fewer prompt tokens than the same
    pair cut only to fit (truncate_prompt_tokens 99)."""
    long_doc = "The capital of France is Paris. " * 10
    plain = _rerank(cross, query=QUERY, documents=[long_doc], truncate_prompt_tokens=99)
    capped = _rerank(cross, query=QUERY, documents=[long_doc], max_tokens_per_doc=10)
    assert capped["usage"]["prompt_tokens"] < plain["usage"]["prompt_tokens"]


@pytest.mark.parametrize("cap", [0, -5])
def test_rerank_max_tokens_per_doc_validation(cross: Reranker, cap: int) -> None:
    """vLLM's test_rerank_max_tokens_per_doc_validation: 0 and negative caps, vLLM's message."""
    body = {"model": cross.name, "query": QUERY, "documents": DOCUMENTS[1:]}
    response = cross.client.post("/rerank", json={**body, "max_tokens_per_doc": cap})
    assert response.status_code == 400
    assert "max_tokens_per_doc must be a positive integer" in response.text


def test_score_max_tokens_per_doc_with_score_template(cross: Reranker) -> None:
    """vLLM's test_score_max_tokens_per_doc_with_score_template: a cap of 15 on the cross-
    encoder path."""
    long_doc = "The capital of France is Paris. " * 20
    answer = _rerank(cross, query=QUERY, documents=[long_doc], max_tokens_per_doc=15)
    assert len(answer["results"]) == 1
    assert answer["usage"]["prompt_tokens"] > 0


@pytest.fixture(scope="module")
def qwen3_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny Qwen3 named as Qwen3-Reranker, its tokenizer adding no special tokens (as
    Qwen's)."""
    return _qwen_like(tmp_path_factory.mktemp("tiny") / "Qwen3-Reranker-tiny")


@pytest.fixture(scope="module")
def qwen3(live_servers: LiveServers, qwen3_dir: Path) -> Reranker:
    # vLLM: Qwen/Qwen3-Reranker-0.6B --max-model-len 256 (512 in test_qwen3_reranker_online.py)
    #   --hf-overrides QWEN3_YES_NO --chat-template qwen3_reranker.jinja
    overrides = json.dumps(QWEN3_YES_NO)
    server = live_servers.serve(qwen3_dir, "qwen3", max_model_len=256, hf_overrides=overrides)
    return Reranker(server, "qwen3", lambda _: [])


@pytest.fixture(scope="module")
def gemma(live_servers: LiveServers, tmp_path_factory: pytest.TempPathFactory) -> Reranker:
    # vLLM: BAAI/bge-reranker-v2-gemma --max-model-len 256 --hf-overrides GEMMA_HF_OVERRIDES
    #   --chat-template bge-reranker-v2-gemma.jinja
    directory = save_tiny_decoder(
        "gemma", tmp_path_factory.mktemp("tiny") / "bge-reranker-v2-gemma"
    )
    overrides = json.dumps(GEMMA_YES)
    server = live_servers.serve(directory, "gemma", max_model_len=256, hf_overrides=overrides)
    return Reranker(server, "gemma", lambda _: [])


@pytest.mark.parametrize("kind", ["cross", "gemma", "qwen3"])
def test_max_tokens_per_doc_paths(request: pytest.FixtureRequest, kind: str) -> None:
    """vLLM's test_{jina,gemma,qwen}_max_tokens_per_doc and ..._reduces_tokens: on the XLM-R
    cross-encoder path (jina-reranker-v2's; here at max_model_len 100, which the cases stay
    under), the chat template path and the score template path, a cap of 10 scores a long
    document and a cap of 5 costs fewer tokens than none."""
    reranker: Reranker = request.getfixturevalue(kind)
    long_doc = "The capital of France is Paris. " * 20
    answer = _rerank(reranker, query=QUERY, documents=[long_doc], max_tokens_per_doc=10)
    assert answer["id"] is not None
    assert len(answer["results"]) == 1
    assert answer["usage"]["prompt_tokens"] > 0
    plain = _rerank(reranker, query=QUERY, documents=[FIVE])
    capped = _rerank(reranker, query=QUERY, documents=[FIVE], max_tokens_per_doc=5)
    assert capped["usage"]["prompt_tokens"] < plain["usage"]["prompt_tokens"]
    if kind != "cross":  # the prompt is the card's: its own words beside the two texts
        tokenizer = AutoTokenizer.from_pretrained(str(MINILM_DIR))
        texts = len(tokenizer(QUERY + " " + FIVE, add_special_tokens=False)["input_ids"])
        assert plain["usage"]["prompt_tokens"] > texts + 10


# scoring/test_qwen3_reranker_online.py

DOCUMENT = "The capital of France is Paris."


def test_score_and_rerank_use_qwen3_reranker_template(qwen3: Reranker, qwen3_dir: Path) -> None:
    """vLLM's test_score_and_rerank_use_qwen3_reranker_template: /score and /rerank count the
    templated prompt's tokens (the model card's prompt; not the plain pair's) and agree; the
    score is also P(yes) of transformers' causal LM over that prompt."""
    tokenizer = AutoTokenizer.from_pretrained(str(qwen3_dir))
    prompt = qwen3_card(QUERY, DOCUMENT)
    assert "<Instruct>:" in prompt
    templated = list(tokenizer(prompt, add_special_tokens=True)["input_ids"])
    plain = tokenizer(text=QUERY, text_pair=DOCUMENT, add_special_tokens=True)["input_ids"]
    assert len(templated) != len(plain)

    body = {"model": qwen3.name, "queries": QUERY, "documents": DOCUMENT}
    score = qwen3.client.post("/score", json=body)
    assert score.status_code == 200, score.text
    ranked = _rerank(qwen3, query=QUERY, documents=[DOCUMENT])
    assert score.json()["usage"]["prompt_tokens"] == len(templated)
    assert ranked["usage"]["prompt_tokens"] == len(templated)
    assert len(score.json()["data"]) == 1
    assert len(ranked["results"]) == 1
    value = score.json()["data"][0]["score"]
    assert value == pytest.approx(ranked["results"][0]["relevance_score"], rel=0.01)

    rows = tokenizer.convert_tokens_to_ids(["no", "yes"])
    assert isinstance(rows, list)
    with torch.inference_mode():
        logits = build_hf_model("qwen3")(input_ids=torch.tensor([templated])).logits[0, -1]
    assert value == pytest.approx(float(torch.softmax(logits[rows], -1)[1]), abs=1e-4)
