"""Jina's `late_chunking: true` on /v1/embeddings, against a transformers reference.

The reference follows jina-ai/late-chunking's tests/test_api.py (the test that checks Jina's API
against a local run): the inputs joined by one space and tokenized without special tokens, each
input's tokens cut where a token's characters reach that input's end, the cues shifted past the
leading special token and the task's instruction, the first input given those and the last one
the closing special token (`_extend_special_tokens(include_prefix=True, include_sep=True)`); the
model runs once over the instruction and the joined text, each input is the mean of its tokens'
final states, then the model's embedding head (Matryoshka cut, normalisation).
"""

from __future__ import annotations

import base64
import json
from collections.abc import Iterator, Sequence
from functools import cache
from pathlib import Path
from typing import Any

import numpy as np
import orjson
import pytest
import torch
from sentence_transformers import quantize_embeddings
from transformers import AutoModel, AutoTokenizer, PreTrainedTokenizerBase

from poolserve.offline import PoolingEngine
from tests.models.test_jina_v3 import PROMPTS, TASKS, adapters, merged, reference, write_remote
from tests.tiny_models import minilm_path, write_st_modules

Span = tuple[int, int]
TEXTS = [
    "Berlin is the capital and largest city of Germany.",
    "Its more than 3.85 million inhabitants make it the most populous city of the EU.",
    "The city is also one of the states of Germany!",
]


def _cues(tokenizer: PreTrainedTokenizerBase, texts: Sequence[str]) -> list[Span]:
    """Each input's tokens in the joined text, without special tokens (Jina's boundary cues:
    an input ends after the token whose characters reach its last one)."""
    offsets = tokenizer(" ".join(texts), add_special_tokens=False, return_offsets_mapping=True)[
        "offset_mapping"
    ]
    ends = np.cumsum([len(t) + 1 for t in texts]) - 1  # each input's end character
    cues, first, index = [], 0, 0
    for position, (_, end) in enumerate(offsets):
        if end >= ends[index]:
            cues.append((first, position + 1))
            first, index = position + 1, index + 1
    assert len(cues) == len(texts)
    return cues


def _extended(cues: Sequence[Span], instruction_tokens: int) -> list[Span]:
    """Jina's _extend_special_tokens with include_prefix and include_sep: past [CLS] and the
    instruction; the first from position 0, the last through [SEP]."""
    shift = 1 + instruction_tokens
    spans = [(start + shift, end + shift) for start, end in cues]
    spans[0] = (0, spans[0][1])
    spans[-1] = (spans[-1][0], spans[-1][1] + 1)
    return spans


def jina_reference(
    model: Any,
    tokenizer: PreTrainedTokenizerBase,
    texts: Sequence[str],
    instruction: str = "",
    dimensions: int | None = None,
    normalized: bool = True,
) -> tuple[np.ndarray, int]:
    """Each input's embedding and the document's token count."""
    instruction_tokens = len(tokenizer(instruction, add_special_tokens=False)["input_ids"])
    spans = _extended(_cues(tokenizer, texts), instruction_tokens)
    ids = tokenizer(instruction + " ".join(texts))["input_ids"]
    with torch.inference_mode():
        states = model(input_ids=torch.tensor([ids])).last_hidden_state[0]
    rows = torch.stack([states[start:end].mean(dim=0) for start, end in spans])
    rows = rows[:, :dimensions] if dimensions is not None else rows
    if normalized:
        rows = torch.nn.functional.normalize(rows, dim=-1)
    assert spans[-1][1] == len(ids)
    return rows.numpy(), len(ids)


def _post(engine: PoolingEngine, body: dict[str, Any], status: int = 200) -> Any:
    reply = engine.request("POST", "/v1/embeddings", orjson.dumps(body))
    assert reply.status == status, reply.body
    return orjson.loads(reply.body)


def _rows(answer: Any) -> np.ndarray:
    """The items' embeddings; each item is exactly OpenAI's (and Jina's) three fields."""
    for index, item in enumerate(answer["data"]):
        assert set(item) == {"object", "index", "embedding"}
        assert item["index"] == index
    return np.asarray([item["embedding"] for item in answer["data"]], dtype=np.float32)


def assert_rows(got: np.ndarray, want: np.ndarray) -> None:
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


# ---- MiniLM: mean pooling and Normalize ---------------------------------------------------------
@cache
def _minilm() -> tuple[Any, PreTrainedTokenizerBase]:
    path = str(minilm_path())
    return AutoModel.from_pretrained(path).eval(), AutoTokenizer.from_pretrained(path)


@pytest.fixture(scope="module")
def minilm() -> Iterator[PoolingEngine]:
    with PoolingEngine(None, served_model_name="m", max_model_len=96) as served:
        yield served


@pytest.mark.parametrize("normalized", [True, False])
def test_each_input_is_the_mean_of_its_tokens_in_the_joined_document(
    minilm: PoolingEngine, normalized: bool
) -> None:
    want, num_tokens = jina_reference(*_minilm(), TEXTS, normalized=normalized)
    answer = _post(minilm, {"input": TEXTS, "late_chunking": True, "normalized": normalized})
    assert_rows(_rows(answer), want)
    assert answer["usage"]["prompt_tokens"] == num_tokens  # the one document, counted once


def test_the_context_reaches_across_inputs(minilm: PoolingEngine) -> None:
    """Late chunking differs from embedding each input alone, and from the plain request."""
    joined = _rows(_post(minilm, {"input": TEXTS, "late_chunking": True}))
    alone = _rows(_post(minilm, {"input": TEXTS, "late_chunking": False}))
    plain = _rows(_post(minilm, {"input": TEXTS}))
    assert np.array_equal(alone, plain)
    assert not np.allclose(joined, alone, atol=1e-3)


def test_one_input_is_its_whole_document(minilm: PoolingEngine) -> None:
    """One input: every token of its prompt, specials included (Jina's first and last span)."""
    model, tokenizer = _minilm()
    want, _ = jina_reference(model, tokenizer, TEXTS[:1])
    ids = tokenizer(TEXTS[0])["input_ids"]
    with torch.inference_mode():
        states = model(input_ids=torch.tensor([ids])).last_hidden_state[0]
    assert_rows(want, torch.nn.functional.normalize(states.mean(dim=0), dim=-1)[None].numpy())
    assert_rows(_rows(_post(minilm, {"input": TEXTS[0], "late_chunking": True})), want)


@pytest.mark.parametrize("kind", ["int8", "binary"])
def test_embedding_type_quantizes_each_input(minilm: PoolingEngine, kind: str) -> None:
    floats, _ = jina_reference(*_minilm(), TEXTS)
    ranges = np.array([[-1.0] * floats.shape[1], [1.0] * floats.shape[1]], dtype=np.float32)
    want = quantize_embeddings(floats, precision=kind, ranges=ranges)  # type: ignore[arg-type]
    answer = _post(minilm, {"input": TEXTS, "late_chunking": True, "embedding_type": kind})
    assert np.array_equal(np.asarray([i["embedding"] for i in answer["data"]]), want)


def test_embedding_type_base64_is_the_float32_rows(minilm: PoolingEngine) -> None:
    want, _ = jina_reference(*_minilm(), TEXTS)
    body = {"input": TEXTS, "late_chunking": True, "embedding_type": "base64"}
    items = _post(minilm, body)["data"]
    got = [np.frombuffer(base64.b64decode(i["embedding"]), np.float32) for i in items]
    assert_rows(np.stack(got), want)


def _error(engine: PoolingEngine, body: dict[str, Any]) -> dict[str, Any]:
    error: dict[str, Any] = _post(engine, body, status=400)["error"]
    return error


def test_the_joined_document_must_fit_the_model(minilm: PoolingEngine) -> None:
    """Each input fits max_model_len (96) alone; joined they do not: 400 before the engine."""
    texts = [" ".join(["word"] * 40)] * 3
    tokenizer = _minilm()[1]
    assert all(len(tokenizer(t)["input_ids"]) < 96 for t in texts)
    assert _post(minilm, {"input": texts})["data"]  # served without late chunking
    error = _error(minilm, {"input": texts, "late_chunking": True})
    assert error["code"] == "context_length_exceeded", error
    assert "joined" in error["message"] and "max_model_len (96)" in error["message"], error


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"input": ["a sentence", "  "]}, "input"),  # a blank input has no tokens of its own
        ({"input": [[101, 2023, 102], [101, 102]]}, "input"),  # token ids
        ({"input": TEXTS, "truncate": True}, "truncate_prompt_tokens"),  # never truncates
        ({"input": [{"image": "data:image/png;base64,AAAA"}]}, "late_chunking"),
        ({"messages": [{"role": "user", "content": "hi"}]}, "messages"),
    ],
)
def test_what_it_cannot_join_is_refused(
    minilm: PoolingEngine, body: dict[str, Any], param: str
) -> None:
    error = _error(minilm, {**body, "late_chunking": True})
    assert error["param"] == param, error


# ---- jina-embeddings-v3 (tiny): task adapter and instruction, Matryoshka dimensions -----------
@pytest.fixture(scope="module")
def jina(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[PoolingEngine, Path]]:
    """The Hub checkpoint with jina-v3's sentence-transformers files (mean pooling, prompts)."""
    directory = write_remote(reference(), adapters(), tmp_path_factory.mktemp("jina_late"))
    write_st_modules(directory, max_seq_length=None, do_lower_case=False)
    st_config = {"prompts": PROMPTS, "default_prompt_name": None}
    (directory / "config_sentence_transformers.json").write_text(json.dumps(st_config))
    with PoolingEngine(str(directory), served_model_name="jina") as served:
        yield served, directory


@pytest.mark.parametrize("dimensions", [None, 32])
@pytest.mark.parametrize("task", ["retrieval.passage", "text-matching"])
def test_task_and_dimensions_on_jina_v3(
    jina: tuple[PoolingEngine, Path], task: str, dimensions: int | None
) -> None:
    """Jina's test request: task, dimensions, late_chunking, embedding_type float."""
    engine, directory = jina
    model = merged(reference(), adapters(), TASKS.index(task))
    tokenizer = AutoTokenizer.from_pretrained(str(directory))
    want, _ = jina_reference(model, tokenizer, TEXTS, PROMPTS[task], dimensions)
    body = {"input": TEXTS, "task": task, "late_chunking": True, "embedding_type": "float"}
    if dimensions is not None:
        body["dimensions"] = dimensions
    assert_rows(_rows(_post(engine, body)), want)
