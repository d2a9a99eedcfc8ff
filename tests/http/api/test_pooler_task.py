"""--pooler-config's `task` (vLLM's PoolerConfig.task): the model's one pooling task, the
default of /v1/pooling and the scorer of /score; a task the model does not serve stops the start."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import httpx
import numpy as np
import pytest
import torch
from transformers import AutoModel, AutoTokenizer

from poolserve.config.pooler import parse_pooler_config
from tests.http.serving import LiveServers
from tests.tiny_models import MINILM_DIR

QUERY = "what is the capital of france"
DOCUMENTS = ["paris is the capital of france", "the cat sat on the mat"]


@pytest.fixture(scope="module")
def token_embed(live_servers: LiveServers) -> httpx.Client:
    # vLLM 0.33's spelling (tests/entrypoints/pooling/token_embed/test_online.py); its earlier
    # releases' `task` is read too. A real `poolserve serve`, as vLLM's test runs against one.
    return live_servers.serve(None, "minilm", pooler_config='{"pooling_task": "token_embed"}')


# Ported from vLLM 0.33's tests/entrypoints/pooling/token_embed/test_online.py (its model,
# multilingual-e5-small, is 384 wide as MiniLM is; the token count is the tokenizer's own).
VLLM_TEXT = "The best thing about vLLM is that it supports many different models"


def test_vllm_pooling_token_embed(token_embed: Any) -> None:
    body = {"model": "minilm", "input": VLLM_TEXT, "encoding_format": "float"}
    response = token_embed.post("/pooling", json={**body, "task": "token_embed"})
    data = response.json()["data"]
    tokens = AutoTokenizer.from_pretrained(MINILM_DIR)(VLLM_TEXT)["input_ids"]
    assert len(data) == 1
    assert len(data[0]["data"]) == len(tokens)
    assert len(data[0]["data"][0]) == 384


@pytest.mark.parametrize("task", ["classify", "token_classify", "plugin"])
def test_vllm_pooling_not_supported(token_embed: Any, task: str) -> None:
    body = {"model": "minilm", "input": "test", "encoding_format": "float", "task": task}
    response = token_embed.post("/pooling", json=body)
    assert response.status_code == 400
    error = response.json()["error"]
    # vLLM: type "BadRequestError"; this server keeps OpenAI's type (docs/api.md, error body)
    assert error["type"] == "invalid_request_error"
    if task != "plugin":  # a task no model here has: refused by the body's schema, naming it
        assert error["message"].startswith(f"Unsupported task: {task!r}"), error
    else:
        assert error["param"] == "task", error
    # vLLM also refuses "embed" here; this server serves a model's other tasks whatever its
    # pooling_task (docs/api.md, --pooler-config): an answer, where vLLM gives an error
    served = token_embed.post("/pooling", json={**body, "task": "embed"})
    assert served.status_code == 200 and len(served.json()["data"][0]["data"]) == 384


def _maxsim_reference(query: str, document: str) -> float:
    """ColBERT's MaxSim over MiniLM's unit-length token states, computed with transformers."""
    tokenizer = AutoTokenizer.from_pretrained(MINILM_DIR)
    model = AutoModel.from_pretrained(MINILM_DIR).eval()

    def states(text: str) -> torch.Tensor:
        with torch.inference_mode():
            hidden = model(**tokenizer(text, return_tensors="pt")).last_hidden_state[0]
        return torch.nn.functional.normalize(hidden.double(), dim=-1)  # [tokens, hidden]

    return float((states(query) @ states(document).T).max(dim=1).values.sum())


def test_token_embed_is_the_pooling_default_and_scores_by_maxsim(token_embed: Any) -> None:
    pooled = token_embed.post("/v1/pooling", json={"input": QUERY}).json()["data"][0]["data"]
    assert np.asarray(pooled).ndim == 2  # one vector per token, as task token_embed
    explicit = token_embed.post("/v1/pooling", json={"input": QUERY, "task": "token_embed"})
    assert explicit.json()["data"][0]["data"] == pooled
    answer = token_embed.post("/score", json={"text_1": QUERY, "text_2": DOCUMENTS})
    assert answer.status_code == 200, answer.text
    scores = [item["score"] for item in answer.json()["data"]]
    for got, document in zip(scores, DOCUMENTS, strict=True):
        want = _maxsim_reference(QUERY, document)
        assert abs(got - want) <= 1e-4 * abs(want), (got, want)
    assert scores[0] > scores[1]  # the related document ranks first
    rerank = token_embed.post("/rerank", json={"query": QUERY, "documents": DOCUMENTS})
    assert [r["relevance_score"] for r in rerank.json()["results"]] == sorted(scores, reverse=True)


def test_embed_task_keeps_cosine_scores(make_client: Callable[..., Any]) -> None:
    with make_client(None) as plain, make_client(None, pooler_config='{"task": "embed"}') as embed:
        body = {"text_1": QUERY, "text_2": DOCUMENTS}
        assert (
            embed.post("/score", json=body).json()["data"]
            == plain.post("/score", json=body).json()["data"]
        )


def test_classify_task_on_a_one_label_classifier_scores_and_on_three_labels_is_404(
    make_client: Callable[..., Any],
) -> None:
    body = {"text_1": QUERY, "text_2": DOCUMENTS}
    task = '{"task": "classify"}'
    with make_client("llama_cls1") as plain, make_client("llama_cls1", pooler_config=task) as one:
        assert (
            one.post("/score", json=body).json()["data"]
            == plain.post("/score", json=body).json()["data"]
        )
    with make_client("llama_cls3", pooler_config=task) as three:
        assert three.post("/score", json=body).status_code == 404
        pooled = three.post("/v1/pooling", json={"input": QUERY}).json()["data"][0]["data"]
        assert len(pooled) == 3  # classify: one probability per label


def test_a_task_the_model_does_not_serve_stops_the_start(make_client: Callable[..., Any]) -> None:
    unsupported = pytest.raises(Exception, match="Unsupported task 'classify'")
    with unsupported as raised, make_client(None, pooler_config='{"task": "classify"}'):
        pass
    assert "embed" in str(raised.value)


def test_score_is_no_pooling_task() -> None:
    with pytest.raises(ValueError, match="score is a route"):
        parse_pooler_config('{"task": "score"}')
    with pytest.raises(ValueError, match="task"):
        parse_pooler_config('{"task": "plugin"}')
    assert parse_pooler_config('{"task": "token_classify"}').task == "token_classify"
    with pytest.raises(ValueError, match="one of pooling_task and task"):
        parse_pooler_config('{"task": "embed", "pooling_task": "embed"}')
