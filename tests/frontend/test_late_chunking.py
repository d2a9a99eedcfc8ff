"""Late chunking over HTTP and the Python API, against transformers.

The reference runs the Hugging Face model over each whole document, takes the mean of every
span's token states (the tokens whose first character, from `return_offsets_mapping`, lies in
the span; special tokens never), then sentence-transformers' own modules after the Transformer
(MiniLM: mean Pooling over those tokens, Normalize).
"""

from __future__ import annotations

import base64
import json
import os
import shutil
from collections.abc import Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from functools import cache
from typing import Any

import numpy as np
import orjson
import pytest
import torch
from transformers import AutoModel, AutoTokenizer, PreTrainedTokenizerBase

from poolserve.frontend.spans import LateChunking, check_inputs, tokenize_documents
from poolserve.frontend.state import ModelHandle
from poolserve.frontend.texts import RawInputs, Truncation, encode_texts, tokenize
from poolserve.offline import PoolingEngine
from poolserve.types.errors import InvalidRequestError
from tests.tiny_decoders import build_hf_decoder, decoder_dirs
from tests.tiny_models import minilm_path

Span = tuple[int, int]
LIMIT = 12  # --max-client-batch-size: the most spans (and inputs) one request may carry
SENTENCE = "Late chunking pools each span from token states that saw the whole document. "
DOCS = [
    "Berlin is the capital of Germany. Its population is about 3.8 million people. "
    "The city is known for its art scene, and for its ünusual café culture!",
    "Late chunking embeds a whole document at once; each sentence then gets a vector.",
    "short one",
]
LONG = SENTENCE * 20  # ~300 tokens: past MiniLM's max_seq_length (256), within max_model_len


def _sentences(text: str) -> list[Span]:
    """Each sentence's characters, plus a span starting inside a word and one over the text."""
    spans, start = [], 0
    for end in [i + 1 for i, c in enumerate(text) if c in ".;!"] + [len(text)]:
        if text[start:end].strip():
            spans.append((start, end))
        start = end
    return [*spans, (6, min(len(text), 40)), (0, len(text))]


@cache
def _tokenizer(path: str) -> PreTrainedTokenizerBase:
    return AutoTokenizer.from_pretrained(path)


@cache
def _minilm() -> torch.nn.Module:
    return AutoModel.from_pretrained(str(minilm_path())).eval()


@cache
def _st_modules() -> tuple[torch.nn.Module, ...]:
    """sentence-transformers' modules after the Transformer (MiniLM: Pooling, Normalize)."""
    from sentence_transformers import SentenceTransformer

    return tuple(SentenceTransformer(str(minilm_path()), device="cpu"))[1:]


def _encoded(path: str, text: str) -> tuple[list[int], list[Span], list[int]]:
    enc = _tokenizer(path)(text, return_offsets_mapping=True, return_special_tokens_mask=True)
    offsets = [(int(start), int(end)) for start, end in enc["offset_mapping"]]
    return list(enc["input_ids"]), offsets, list(enc["special_tokens_mask"])


def _members(
    path: str, text: str, spans: Sequence[Span] | None, chunk_size: int | None, prompt: str
) -> tuple[list[int], list[list[int]], list[Span]]:
    """The prompt's ids, each span's token positions (the start rule), the spans' characters."""
    ids, offsets, special = _encoded(path, prompt + text)
    shift = len(prompt)
    own = [p for p in range(len(ids)) if not special[p] and offsets[p][0] >= shift]
    if spans is not None:
        members = [[p for p in own if s <= offsets[p][0] - shift < e] for s, e in spans]
        return ids, members, list(spans)
    assert chunk_size is not None
    windows = [own[k : k + chunk_size] for k in range(0, len(own), chunk_size)]
    chars = [(offsets[w[0]][0] - shift, max(offsets[p][1] for p in w) - shift) for w in windows]
    return ids, windows, chars


def minilm_reference(
    text: str, spans: Sequence[Span] | None = None, chunk_size: int | None = None, prompt: str = ""
) -> tuple[np.ndarray, list[Span], int]:
    """Each span's embedding, the spans' characters, the document's token count."""
    ids, members, chars = _members(str(minilm_path()), text, spans, chunk_size, prompt)
    with torch.inference_mode():
        states = _minilm()(input_ids=torch.tensor([ids])).last_hidden_state[0]
        rows = []
        for positions in members:
            features: dict[str, Any] = {
                "token_embeddings": states[positions][None],
                "attention_mask": torch.ones(1, len(positions), dtype=torch.long),
            }
            for module in _st_modules():
                features = module(features)
            rows.append(features["sentence_embedding"][0])
    return torch.stack(rows).numpy(), chars, len(ids)


def assert_rows(got: Any, want: np.ndarray) -> None:
    np.testing.assert_allclose(np.asarray(got, dtype=np.float32), want, rtol=1e-5, atol=1e-5)


@pytest.fixture(scope="module")
def engine() -> Iterator[PoolingEngine]:
    with PoolingEngine(None, served_model_name="m", max_client_batch_size=LIMIT) as served:
        yield served


def _post(engine: PoolingEngine, path: str, body: dict[str, Any], status: int = 200) -> Any:
    reply = engine.request("POST", path, orjson.dumps(body))
    assert reply.status == status, reply.body
    return orjson.loads(reply.body)


def _check_items(
    answer: Any, key: str, wants: Sequence[tuple[np.ndarray, list[Span], int]]
) -> None:
    """Items in input then span order: running index, input_index, span, the reference row."""
    expected = [
        (i, list(span), row)
        for i, (rows, chars, _) in enumerate(wants)
        for span, row in zip(chars, rows, strict=True)
    ]
    assert len(answer["data"]) == len(expected)
    for index, (item, (input_index, span, row)) in enumerate(
        zip(answer["data"], expected, strict=True)
    ):
        assert (item["index"], item["input_index"], item["span"]) == (index, input_index, span)
        assert_rows(item[key], row)
    assert answer["usage"]["prompt_tokens"] == sum(count for _, _, count in wants)


# ---- the token ids are the ordinary path's ----------------------------------------------------
def _handle(engine: PoolingEngine) -> ModelHandle:
    return engine.engine.model


def _kept(reason: str) -> None:
    raise AssertionError(f"refused: {reason}")


def test_token_ids_are_exactly_the_ordinary_paths(engine: PoolingEngine) -> None:
    texts = [*DOCS, LONG, "literal [SEP] in text", "  spaced\tout \n text  ", "日本語のテキスト"]
    model = _handle(engine)
    whole = Truncation(None, "right", model.max_model_len)

    async def both() -> tuple[list[list[int]], list[list[int]]]:
        documents = await tokenize_documents(texts, 0, model, model.max_model_len, True, _kept)
        ordinary = await tokenize(RawInputs(tuple(texts), None), model, whole, _kept)
        return [d.token_ids for d in documents], ordinary

    ours, ordinary = engine._call(both())  # on the engine's loop, which owns the char budget
    assert ours == ordinary == encode_texts(model, texts, whole)
    assert ours == [_tokenizer(str(minilm_path()))(t)["input_ids"] for t in texts]
    assert len(ours[3]) > 256  # past sentence-transformers' max_seq_length: nothing cut


# ---- answers equal the reference --------------------------------------------------------------
def test_spans_equal_the_reference_on_both_routes(engine: PoolingEngine) -> None:
    texts = [DOCS[0], DOCS[1], LONG]
    spans = [_sentences(DOCS[0]), _sentences(DOCS[1])[:2], [(0, 77), (77, len(LONG))]]
    wants = [minilm_reference(t, s) for t, s in zip(texts, spans, strict=True)]
    late = {"spans": [[list(span) for span in ranges] for ranges in spans]}
    answer = _post(engine, "/v1/embeddings", {"input": texts, "late_chunking": late})
    _check_items(answer, "embedding", wants)
    assert all(item["object"] == "embedding" for item in answer["data"])
    pooled = _post(engine, "/v1/pooling", {"input": texts, "task": "embed", "late_chunking": late})
    _check_items(pooled, "data", wants)
    assert all(item["object"] == "pooling" for item in pooled["data"])


def test_chunk_size_windows_equal_the_reference(engine: PoolingEngine) -> None:
    texts = DOCS
    wants = [minilm_reference(text, chunk_size=5) for text in texts]
    assert [len(rows) for rows, _, _ in wants] == [7, 4, 1]  # the last window may be short
    body = {"input": texts, "late_chunking": {"chunk_size": 5}}
    _check_items(_post(engine, "/v1/embeddings", body), "embedding", wants)
    # one input as a plain string; a window larger than the text: the whole text, one row
    single = _post(engine, "/v1/pooling", {"input": DOCS[1], "late_chunking": {"chunk_size": 500}})
    _check_items(single, "data", [minilm_reference(DOCS[1], chunk_size=500)])


def test_normalize_false_is_the_plain_span_mean(engine: PoolingEngine) -> None:
    spans = _sentences(DOCS[1])
    body = {"input": DOCS[1], "normalize": False, "late_chunking": {"spans": [spans]}}
    answer = _post(engine, "/v1/embeddings", body)
    ids, members, _ = _members(str(minilm_path()), DOCS[1], spans, None, "")
    with torch.inference_mode():
        states = _minilm()(input_ids=torch.tensor([ids])).last_hidden_state[0]
    for item, positions in zip(answer["data"], members, strict=True):
        assert_rows(item["embedding"], states[positions].mean(0).numpy())


def _f32(values: list[float]) -> np.ndarray:
    """A float answer's numbers as the float32 values they print."""
    return np.asarray(values, dtype=np.float32)


def test_base64_and_bytes_carry_the_same_rows(engine: PoolingEngine) -> None:
    late = {"spans": [_sentences(DOCS[0]), [(0, 5)]]}
    body = {"input": [DOCS[0], DOCS[2]], "late_chunking": late}
    floats = _post(engine, "/v1/embeddings", body)["data"]
    encoded = _post(engine, "/v1/embeddings", {**body, "encoding_format": "base64"})["data"]
    pooled = _post(engine, "/v1/pooling", {**body, "encoding_format": "base64"})["data"]
    for plain, b64, pool in zip(floats, encoded, pooled, strict=True):
        assert (b64["index"], b64["input_index"], b64["span"]) == (
            plain["index"],
            plain["input_index"],
            plain["span"],
        )
        assert pool["shape"] == [384]
        for text in (b64["embedding"], pool["data"]):
            assert np.array_equal(
                np.frombuffer(base64.b64decode(text), "<f4"), _f32(plain["embedding"])
            )
    reply = engine.request(
        "POST", "/v1/embeddings", orjson.dumps({**body, "encoding_format": "bytes"})
    )
    assert reply.status == 200, reply.body
    items = json.loads(reply.headers["metadata"])["data"]
    for item, plain in zip(items, floats, strict=True):
        row = np.frombuffer(reply.body[item["start"] : item["end"]], "<f4")
        assert (item["index"], item["input_index"], item["span"]) == (
            plain["index"],
            plain["input_index"],
            plain["span"],
        )
        assert np.array_equal(row, _f32(plain["embedding"])) and item["shape"] == [384]


def test_mixed_with_ordinary_requests_under_concurrency(engine: PoolingEngine) -> None:
    from sentence_transformers import SentenceTransformer

    plain = SentenceTransformer(str(minilm_path()), device="cpu").encode(DOCS)
    spans = [_sentences(text) for text in DOCS]
    late = [minilm_reference(text, s) for text, s in zip(DOCS, spans, strict=True)]
    windows = [minilm_reference(text, chunk_size=9) for text in DOCS]

    def call(index: int) -> None:
        kind, path = index % 3, ("/v1/embeddings", "/v1/pooling")[index % 2]
        key = "embedding" if path == "/v1/embeddings" else "data"
        if kind == 0:
            answer = _post(engine, path, {"input": DOCS})
            for item, want in zip(answer["data"], plain, strict=True):
                assert_rows(item[key], want)
        elif kind == 1:
            body = {"input": DOCS[:2], "late_chunking": {"spans": spans[:2]}}
            _check_items(_post(engine, path, body), key, late[:2])
        else:
            body = {"input": DOCS, "late_chunking": {"chunk_size": 9}}
            _check_items(_post(engine, path, body), key, windows)

    with ThreadPoolExecutor(6) as pool:
        list(pool.map(call, range(18)))


def test_python_api_equals_the_http_answer(engine: PoolingEngine) -> None:
    texts = [DOCS[0], DOCS[2]]
    for late in ({"spans": [_sentences(DOCS[0]), [(0, 9)]]}, {"chunk_size": 4}):
        answer = _post(engine, "/v1/embeddings", {"input": texts, "late_chunking": late})
        pooled = engine.embed(texts, late_chunking=late)
        for index, item in enumerate(pooled):
            rows = [d["embedding"] for d in answer["data"] if d["input_index"] == index]
            np.testing.assert_allclose(item.data, np.asarray(rows, np.float32), atol=1e-6)
            assert item.prompt_tokens == len(_encoded(str(minilm_path()), texts[index])[0])
    (one,) = engine.embed(DOCS[1], late_chunking={"spans": [[(0, 20), (20, 40)]]})
    assert one.data.shape == (2, 384)


def test_python_api_refuses_as_the_route_does(engine: PoolingEngine) -> None:
    with pytest.raises(InvalidRequestError) as caught:
        engine.embed(DOCS[:1], late_chunking={"spans": [[(0, 5)]], "chunk_size": 3})
    assert caught.value.param == "late_chunking"
    with pytest.raises(InvalidRequestError) as caught:
        engine.embed(DOCS[:2], late_chunking={"spans": [[(0, 5)]]})
    assert caught.value.param == "late_chunking.spans"
    with pytest.raises(InvalidRequestError) as caught:
        engine.embed(DOCS[:1], late_chunking={"spans": [[(0, 999)]]})
    assert caught.value.param == "late_chunking.spans[0][0]"
    with pytest.raises(InvalidRequestError) as caught:
        engine.encode(DOCS[:1], "token_embed", late_chunking={"chunk_size": 3})
    assert caught.value.param == "task"


# ---- a prepended prompt shifts nothing: spans index the text as sent ---------------------------
@pytest.fixture(scope="module")
def prompted(tmp_path_factory: pytest.TempPathFactory) -> Iterator[PoolingEngine]:
    """MiniLM with sentence-transformers prompts; `query` is the default."""
    directory = tmp_path_factory.mktemp("prompted") / "minilm"
    shutil.copytree(minilm_path(), directory, copy_function=os.symlink)
    config = directory / "config_sentence_transformers.json"
    config.unlink()
    prompts = {"query": "query: ", "passage": "passage: "}
    config.write_text(json.dumps({"prompts": prompts, "default_prompt_name": "query"}))
    with PoolingEngine(str(directory), served_model_name="m") as served:
        yield served


@pytest.mark.parametrize(
    ("fields", "prompt"),
    [({}, "query: "), ({"prompt_name": "passage"}, "passage: "), ({"prompt": "Doc"}, "Doc")],
)
def test_a_prompt_leads_the_text_and_belongs_to_no_span(
    prompted: PoolingEngine, fields: dict[str, str], prompt: str
) -> None:
    spans = _sentences(DOCS[0])
    wants = [minilm_reference(DOCS[0], spans, prompt=prompt)]
    body = {"input": [DOCS[0]], "late_chunking": {"spans": [spans]}, **fields}
    _check_items(_post(prompted, "/v1/embeddings", body), "embedding", wants)
    windows = [minilm_reference(DOCS[1], chunk_size=6, prompt=prompt)]
    body = {"input": [DOCS[1]], "late_chunking": {"chunk_size": 6}, **fields}
    _check_items(_post(prompted, "/v1/pooling", body), "data", windows)


# ---- a causal decoder: chunked prefill cuts the document --------------------------------------
DECODER = "gemma"
BUDGET = 32  # --max-num-batched-tokens: the document takes several steps


def test_a_decoder_document_through_chunked_prefill(
    tmp_path_factory: pytest.TempPathFactory,
) -> None:
    directory = str(decoder_dirs(tmp_path_factory)(DECODER))
    text = SENTENCE * 6
    spans = [(0, 30), (10, 90), (90, len(text)), (0, len(text))]
    ids, members, _ = _members(directory, text, spans, None, "")
    assert len(ids) > 2 * BUDGET
    with torch.inference_mode():
        states = build_hf_decoder(DECODER).base_model(input_ids=torch.tensor([ids]))
    hidden = states.last_hidden_state[0].double()
    want = torch.nn.functional.normalize(torch.stack([hidden[m].mean(0) for m in members]), dim=-1)
    settings = {"served_model_name": "d", "max_num_batched_tokens": BUDGET}
    with PoolingEngine(directory, **settings) as served:
        body = {"input": [text, "a neighbour"], "late_chunking": {"spans": [spans, [(0, 11)]]}}
        answer = _post(served, "/v1/embeddings", body)
        ordinary = _post(served, "/v1/embeddings", {"input": [text]})  # LAST: the usual path
        # the prefix cache now holds the document's blocks: late chunking must not start past them
        again = _post(served, "/v1/embeddings", body)
    for reply in (answer, again):
        rows = [item["embedding"] for item in reply["data"] if item["input_index"] == 0]
        assert_rows(rows, want.float().numpy())
    assert_rows(
        ordinary["data"][0]["embedding"],
        torch.nn.functional.normalize(hidden[-1], dim=-1).float().numpy(),
    )


# ---- refusals: 400 naming the field, never a 500 ---------------------------------------------
def _body(late: object, text: object = "hello", **fields: object) -> dict[str, object]:
    return {"input": text, "late_chunking": late, **fields}


EMBEDDINGS, POOLING = "/v1/embeddings", "/v1/pooling"
CHUNKS, SPAN = {"chunk_size": 2}, {"spans": [[[0, 5]]]}
CHAT = {"messages": [{"role": "user", "content": "hi"}], "late_chunking": SPAN}
# pydantic's refusals name the body's field (their message names the path inside it)
REFUSED: list[tuple[str, dict[str, Any], str]] = [
    (EMBEDDINGS, _body(CHUNKS, [[101, 7592, 102]]), "input"),
    (EMBEDDINGS, CHAT, "messages"),
    (EMBEDDINGS, _body({}), "late_chunking"),
    (EMBEDDINGS, _body({**SPAN, **CHUNKS}), "late_chunking"),
    (EMBEDDINGS, _body({**CHUNKS, "x": 1}), "late_chunking"),
    # Jina's boolean is /v1/embeddings' (tests/http/api/test_jina_late_chunking.py), not vLLM's
    (POOLING, _body(True), "late_chunking"),
    (EMBEDDINGS, _body({"chunk_size": 0}), "late_chunking"),
    (EMBEDDINGS, _body({"chunk_size": 2.5}), "late_chunking"),
    (EMBEDDINGS, _body({"chunk_size": "2"}), "late_chunking"),
    (EMBEDDINGS, _body({"spans": [[[0.0, 3]]]}), "late_chunking"),
    (EMBEDDINGS, _body({"spans": [[[0, 1, 2]]]}), "late_chunking"),
    (EMBEDDINGS, _body({"spans": [[[0, 1]]]}, ["hello", "there"]), "late_chunking.spans"),
    (EMBEDDINGS, _body({"spans": [[]]}), "late_chunking.spans[0]"),
    (EMBEDDINGS, _body({"spans": [[[0, 9]]]}), "late_chunking.spans[0][0]"),
    (EMBEDDINGS, _body({"spans": [[[3, 3]]]}), "late_chunking.spans[0][0]"),
    (EMBEDDINGS, _body({"spans": [[[0, 2], [-1, 2]]]}), "late_chunking.spans[0][1]"),
    # no token starts inside: the middle of a word, or a run of spaces
    (EMBEDDINGS, _body({"spans": [[[1, 5]]]}), "late_chunking.spans[0][0]"),
    (EMBEDDINGS, _body({"spans": [[[1, 3]]]}, "a   b"), "late_chunking.spans[0][0]"),
    # more spans than the document's 3 tokens; more than --max-client-batch-size in all
    (EMBEDDINGS, _body({"spans": [[[0, 5]] * 4]}), "late_chunking.spans[0]"),
    (EMBEDDINGS, _body({"spans": [[[0, 1]] * 7] * 2}, ["a", "b"]), "late_chunking.spans"),
    (EMBEDDINGS, _body(CHUNKS, " \t "), "late_chunking.chunk_size"),
    (EMBEDDINGS, _body(CHUNKS, [SENTENCE] * 2), "late_chunking.chunk_size"),
    (EMBEDDINGS, _body({"chunk_size": 64}, SENTENCE * 40), "input"),  # past max_model_len
    (EMBEDDINGS, _body(CHUNKS, truncate_prompt_tokens=3), "truncate_prompt_tokens"),
    (POOLING, _body(CHUNKS, stream=True), "stream"),
    (POOLING, _body(CHUNKS, task="token_embed"), "task"),
    (POOLING, _body(CHUNKS, task="embed_sparse"), "task"),
]


@pytest.mark.parametrize(("path", "body", "param"), REFUSED)
def test_bad_requests_are_400_naming_the_field(
    engine: PoolingEngine, path: str, body: dict[str, Any], param: str
) -> None:
    error = _post(engine, path, body, status=400)["error"]
    assert error["param"] == param, error
    assert "late_chunking" in error["message"] or param.startswith("late_chunking"), error


def test_spans_per_input_are_bounded_by_max_model_len(engine: PoolingEngine) -> None:
    raw, model = RawInputs(("hello",), None), _handle(engine)
    with pytest.raises(InvalidRequestError) as caught:
        check_inputs(LateChunking(spans=(((0, 1),) * 5,)), raw, model, max_len=4, limit=100)
    assert caught.value.param == "late_chunking.spans[0]"
    check_inputs(LateChunking(spans=(((0, 1),) * 4,)), raw, model, max_len=4, limit=100)


def test_a_server_with_chunked_processing_still_pools_spans_from_one_pass() -> None:
    # chunked processing slices long embed inputs; a late-chunking document is never sliced
    chunked = json.dumps({"enable_chunked_processing": True})
    with PoolingEngine(
        None, served_model_name="m", max_model_len=64, pooler_config=chunked
    ) as served:
        body = {"input": DOCS[1], "late_chunking": {"chunk_size": 2}}
        answer = _post(served, "/v1/embeddings", body)
    _check_items(answer, "embedding", [minilm_reference(DOCS[1], chunk_size=2)])
