"""LLM rerankers scored with their own prompts: each model card's recipe, instruction, override."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from transformers import AutoTokenizer

from poolserve.frontend.score_recipes import RECIPES
from poolserve.frontend.score_template import ScoreTemplate, render_pair
from tests.http.api.test_score import serve
from tests.tiny_models import build_hf_model, save_tiny_model
from tests.tiny_rerankers import QWEN3_YES_NO, save_cross_encoder

QUERY = "what is the capital of france"
DOCUMENTS = ["paris is the capital of france", "berlin is in germany"]
# The model cards' text, typed here from the cards (not from poolserve's code).
QWEN3_PREFIX = (
    "<|im_start|>system\nJudge whether the Document meets the requirements based on the Query "
    'and the Instruct provided. Note that the answer can only be "yes" or "no".<|im_end|>\n'
    "<|im_start|>user\n"
)
QWEN3_SUFFIX = "<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n"
QWEN3_DEFAULT = "Given a web search query, retrieve relevant passages that answer the query"
BGE_PROMPT = (
    "Given a query A and a passage B, determine whether the passage contains an answer to the "
    "query by providing a prediction of either 'Yes' or 'No'."
)
MXBAI_PREFIX = (
    "<|im_start|>system\nYou are Qwen, created by Alibaba Cloud. You are a helpful "
    "assistant.<|im_end|>\n<|im_start|>user\n"
)
MXBAI_TASK = (
    "You are a search relevance expert who evaluates how well documents match search queries. "
    "For each query-document pair, carefully analyze the semantic relationship between them, "
    "then provide your binary relevance judgment (0 for not relevant, 1 for relevant).\n"
    "Relevance:"
)
MXBAI_SUFFIX = "<|im_end|>\n<|im_start|>assistant\n"


def qwen3_card(query: str, doc: str, instruction: str = QWEN3_DEFAULT) -> str:
    """Qwen3-Reranker's card: format_instruction between the prefix and the suffix."""
    middle = f"<Instruct>: {instruction}\n<Query>: {query}\n<Document>: {doc}"
    return QWEN3_PREFIX + middle + QWEN3_SUFFIX


def bge_gemma_card(query: str, passage: str, prompt: str = BGE_PROMPT) -> str:
    """FlagEmbedding's LLM reranker, as text (its <bos> is the tokenizer's own)."""
    return f"A: {query}\nB: {passage}\n{prompt}"


def mxbai_card(query: str, document: str, instruction: str | None = None) -> str:
    """mxbai-rerank's v2 prepare_inputs, as text."""
    head = f"instruction: {instruction}\n" if instruction else ""
    body = f"{head}query: {query}\ndocument: {document}\n{MXBAI_TASK}"
    return MXBAI_PREFIX + body + MXBAI_SUFFIX


def _qwen_like(directory: Path) -> Path:
    """The tiny Qwen3 with a tokenizer that, like Qwen's, adds no special tokens."""
    save_tiny_model("qwen3", directory)
    tokenizer_json = directory / "tokenizer.json"
    data = json.loads(tokenizer_json.read_text())
    data["post_processor"] = None
    tokenizer_json.write_text(json.dumps(data))
    config = directory / "tokenizer_config.json"
    data = json.loads(config.read_text())
    data["tokenizer_class"] = "PreTrainedTokenizerFast"
    config.write_text(json.dumps(data))
    return directory


@pytest.fixture(scope="module")
def qwen3_reranker(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _qwen_like(tmp_path_factory.mktemp("tiny") / "Qwen3-Reranker-tiny")


@pytest.mark.parametrize(
    ("name", "instruction", "card"),
    [
        ("Qwen3-Reranker", None, qwen3_card(QUERY, DOCUMENTS[0])),
        ("Qwen3-Reranker", "find it", qwen3_card(QUERY, DOCUMENTS[0], "find it")),
        ("bge-reranker-v2-gemma", None, bge_gemma_card(QUERY, DOCUMENTS[0])),
        ("bge-reranker-v2-gemma", "judge", bge_gemma_card(QUERY, DOCUMENTS[0], "judge")),
        ("mxbai-rerank-v2", None, mxbai_card(QUERY, DOCUMENTS[0])),
        ("mxbai-rerank-v2", "be strict", mxbai_card(QUERY, DOCUMENTS[0], "be strict")),
    ],
)
def test_prompt_is_the_model_cards_character_for_character(
    qwen3_reranker: Path, name: str, instruction: str | None, card: str
) -> None:
    recipe = next(r for r in RECIPES if r.name == name)
    tokenizer = AutoTokenizer.from_pretrained(qwen3_reranker)
    template = ScoreTemplate(recipe.template, name, recipe.default_instruction, True)
    assert render_pair(tokenizer, template, QUERY, DOCUMENTS[0], instruction) == card


def _card_scores(
    directory: Path, instruction: str = QWEN3_DEFAULT, documents: list[str] = DOCUMENTS
) -> list[float]:
    """The Qwen3-Reranker card's transformers recipe: prefix, pair and suffix tokenized apart,
    the causal LM's last-token logits of "no" and "yes", softmax, P(yes)."""
    tokenizer = AutoTokenizer.from_pretrained(directory)
    model = build_hf_model("qwen3")
    no, yes = tokenizer.convert_tokens_to_ids(["no", "yes"])
    prefix = tokenizer.encode(QWEN3_PREFIX, add_special_tokens=False)
    suffix = tokenizer.encode(QWEN3_SUFFIX, add_special_tokens=False)
    scores = []
    for doc in documents:
        middle = f"<Instruct>: {instruction}\n<Query>: {QUERY}\n<Document>: {doc}"
        ids = prefix + tokenizer(middle)["input_ids"] + suffix
        with torch.no_grad():
            logits = model(input_ids=torch.tensor([ids])).logits[0, -1, [no, yes]]
        scores.append(float(torch.softmax(logits, -1)[1]))
    return scores


def _score(client: Any, **body: Any) -> list[float]:
    reply = client.post("/score", json={"queries": QUERY, "documents": DOCUMENTS, **body})
    assert reply.status_code == 200, reply.text
    return [d["score"] for d in reply.json()["data"]]


def _rerank(client: Any, **body: Any) -> list[float]:
    reply = client.post("/rerank", json={"query": QUERY, "documents": DOCUMENTS, **body})
    assert reply.status_code == 200, reply.text
    results = sorted(reply.json()["results"], key=lambda r: r["index"])
    return [r["relevance_score"] for r in results]


def test_qwen3_reranker_scores_as_its_card_on_score_and_rerank(qwen3_reranker: Path) -> None:
    want = _card_scores(qwen3_reranker)
    custom = _card_scores(qwen3_reranker, "Find passages about Germany")
    assert max(abs(a - b) for a, b in zip(want, custom, strict=True)) > 1e-4
    with serve(qwen3_reranker, hf_overrides=json.dumps(QWEN3_YES_NO)) as client:
        np.testing.assert_allclose(_score(client), want, atol=1e-4)
        np.testing.assert_allclose(_rerank(client), want, atol=1e-4)
        np.testing.assert_allclose(_score(client, instruction=QWEN3_DEFAULT), want, atol=1e-4)
        given = {"instruction": "Find passages about Germany"}
        np.testing.assert_allclose(_score(client, **given), custom, atol=1e-4)
        np.testing.assert_allclose(_rerank(client, **given), custom, atol=1e-4)
        # truncation cuts the document, never the template: the prompt still ends the card's way
        one = {"queries": QUERY, "documents": DOCUMENTS[:1]}
        full = client.post("/score", json=one).json()["usage"]["prompt_tokens"]
        cut = client.post("/score", json={**one, "truncate_prompt_tokens": full - 2})
        assert cut.status_code == 200, cut.text
        assert cut.json()["usage"]["prompt_tokens"] <= full - 2
        want_cut = _card_scores(qwen3_reranker, documents=["paris is the capital"])
        np.testing.assert_allclose([cut.json()["data"][0]["score"]], want_cut, atol=1e-4)


def test_score_template_setting_overrides_and_none_turns_it_off(
    qwen3_reranker: Path, tmp_path: Path
) -> None:
    # vLLM's form: the pair as messages with the roles query and document
    source = (
        '{{ (messages | selectattr("role", "eq", "query") | first).content }} | '
        '{{ (messages | selectattr("role", "eq", "document") | first).content }}'
    )
    path = tmp_path / "mine.jinja"
    path.write_text(source)
    tokenizer = AutoTokenizer.from_pretrained(qwen3_reranker)
    model = build_hf_model("qwen3")
    no, yes = tokenizer.convert_tokens_to_ids(["no", "yes"])

    def reference(text: str) -> float:
        ids = torch.tensor([tokenizer(text)["input_ids"]])
        with torch.no_grad():
            logits = model(input_ids=ids).logits[0, -1, [no, yes]]
        return float(torch.softmax(logits, -1)[1])

    overrides = json.dumps(QWEN3_YES_NO)
    with serve(qwen3_reranker, hf_overrides=overrides, score_template=str(path)) as client:
        want = [reference(f"{QUERY} | {doc}") for doc in DOCUMENTS]
        np.testing.assert_allclose(_score(client), want, atol=1e-4)
        # no instruction slot: ignored, as vLLM ignores it
        np.testing.assert_allclose(_score(client, instruction="anything"), want, atol=1e-4)
    with serve(qwen3_reranker, hf_overrides=overrides, score_template="none") as client:
        want = [reference(QUERY + doc) for doc in DOCUMENTS]
        np.testing.assert_allclose(_score(client), want, atol=1e-4)


def test_a_cross_encoder_keeps_its_pair_layout_and_ignores_instruction(tmp_path: Path) -> None:
    with serve(save_cross_encoder("bert_cls", tmp_path)) as client:
        plain = _score(client)
        np.testing.assert_allclose(_score(client, instruction="be strict"), plain, atol=1e-6)
