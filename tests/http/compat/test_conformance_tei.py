"""Conformance with text-embeddings-inference 1.9.3 on its own routes.

TEI's README and quick-tour request bodies are replayed unchanged; answers are checked field by
field against transformers / sentence-transformers (and the `tokenizers` library TEI runs);
errors must come in TEI's `{"error", "error_type"}` body with TEI's statuses (router/src/lib.rs
`ErrorType`, server.rs: Empty 400, Validation and Tokenizer 422, Backend 424, Overloaded 429,
Unhealthy 503), never a 500; timing headers in TEI's whole milliseconds.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import transformers
from starlette.testclient import TestClient
from tokenizers import Tokenizer

from poolserve.config.settings import ServerSettings
from poolserve.http.app import create_app
from tests.http.serving import minilm_client, queue_taken
from tests.tiny_encoders import (
    TINY_ENCODERS,
    _perturb,
    build_hf_encoder,
    encoder_dirs,
    save_tiny_encoder,
)
from tests.tiny_models import SPECIAL_TOKENS, VOCAB_SIZE, write_st_modules
from tests.tiny_rerankers import build_cross_encoder, save_cross_encoder

# TEI's README and quick-tour bodies, as published
README_EMBED = {"inputs": "What is Deep Learning?"}
TOUR_EMBED_BATCH = {"inputs": ["Today is a nice day", "I like you"]}
README_RERANK = {
    "query": "What is Deep Learning?",
    "texts": ["Deep Learning is not...", "Deep learning is..."],
}
TOUR_RERANK = {**README_RERANK, "raw_scores": False}
README_PREDICT = {"inputs": "I like you."}
TOUR_PREDICT_BATCH = {"inputs": [["I like you."], ["I hate pineapples"]]}
README_EMBED_SPARSE = {"inputs": "I like you."}
# the OpenAPI examples (SimilarityInput, TokenizeResponse/DecodeResponse's "test")
OPENAPI_SIMILARITY = {
    "inputs": {
        "source_sentence": "What is Deep Learning?",
        "sentences": ["What is Machine Learning?"],
    }
}
TIMING_HEADERS = (
    "x-compute-time",
    "x-compute-characters",
    "x-compute-tokens",
    "x-total-time",
    "x-tokenization-time",
    "x-queue-time",
    "x-inference-time",
)
LABELS = {0: "contradiction", 1: "entailment", 2: "neutral"}
PROMPTS = {"query": "query: ", "passage": "passage: ", "empty": ""}


def _close(got: object, want: np.ndarray) -> None:
    arr = np.asarray(got, dtype=np.float32)
    assert arr.shape == want.shape, (arr.shape, want.shape)
    assert float(np.abs(arr - want).max()) <= 1e-4 * max(float(np.abs(want).max()), 1e-6)


def _ok(response: Any) -> Any:
    assert response.status_code == 200, response.text
    assert response.headers["content-type"] == "application/json"
    return response.json()


def _tei_error(response: Any, status: int, error_type: str) -> str:
    """TEI's error body, exactly its two fields; returns the message."""
    assert response.status_code == status, response.text
    body = response.json()
    assert set(body) == {"error", "error_type"}, body
    assert body["error_type"] == error_type, body
    assert isinstance(body["error"], str) and "Traceback" not in body["error"]
    return str(body["error"])


def _timings(response: Any, characters: int, tokens: int) -> None:
    """TEI's headers: integer milliseconds, its character and token counts."""
    for name in TIMING_HEADERS:
        assert response.headers[name].isdigit(), (name, response.headers[name])
    assert int(response.headers["x-compute-characters"]) == characters
    assert int(response.headers["x-compute-tokens"]) == tokens
    assert response.headers["x-compute-time"] == response.headers["x-total-time"]


@contextmanager
def _serve(directory: Path | None, **settings: Any) -> Iterator[TestClient]:
    model = str(directory) if directory is not None else None
    with TestClient(create_app(ServerSettings(model=model, **settings))) as client:
        yield client


@pytest.fixture(scope="module", params=["app", "live"])
def minilm(request: pytest.FixtureRequest) -> Iterator[Any]:
    """MiniLM behind the in-process app and behind a real server process."""
    with minilm_client(request.param, lambda: request.getfixturevalue("live_minilm")) as client:
        yield client


@pytest.fixture(scope="module")
def st_model(minilm_dir: Path) -> Any:
    from sentence_transformers import SentenceTransformer

    return SentenceTransformer(str(minilm_dir), device="cpu")


def test_readme_embed_bodies(minilm: TestClient, st_model: Any) -> None:
    response = minilm.post("/embed", json=README_EMBED)
    _close(_ok(response), st_model.encode([README_EMBED["inputs"]], normalize_embeddings=True))
    tokens = len(st_model.tokenizer(README_EMBED["inputs"])["input_ids"])
    _timings(response, len(README_EMBED["inputs"]), tokens)
    batch = minilm.post("/embed", json=TOUR_EMBED_BATCH)
    _close(_ok(batch), st_model.encode(TOUR_EMBED_BATCH["inputs"], normalize_embeddings=True))
    texts = TOUR_EMBED_BATCH["inputs"]
    tokens = sum(len(ids) for ids in st_model.tokenizer(texts)["input_ids"])
    _timings(batch, sum(len(t) for t in texts), tokens)
    # POST / of an embedding model is /embed, with the same headers
    root = minilm.post("/", json=README_EMBED)
    assert _ok(root) == _ok(response)
    assert set(TIMING_HEADERS) <= set(root.headers)


def test_openapi_similarity_and_embed_all(minilm: TestClient, st_model: Any) -> None:
    got = minilm.post("/similarity", json=OPENAPI_SIMILARITY)
    inputs = OPENAPI_SIMILARITY["inputs"]
    vectors = st_model.encode([inputs["source_sentence"], *inputs["sentences"]])
    _close(_ok(got), st_model.similarity(vectors[:1], vectors[1:]).numpy()[0])
    chars = len(inputs["source_sentence"]) + sum(len(s) for s in inputs["sentences"])
    assert int(got.headers["x-compute-characters"]) == chars
    hidden = _ok(minilm.post("/embed_all", json=README_EMBED))
    tokenizer = st_model.tokenizer
    model = st_model[0].auto_model
    with torch.inference_mode():
        want = model(**tokenizer(README_EMBED["inputs"], return_tensors="pt")).last_hidden_state
    _close(hidden, want.numpy())


def test_tokenize_and_decode_examples(minilm: TestClient, minilm_dir: Path) -> None:
    reference = Tokenizer.from_file(str(minilm_dir / "tokenizer.json"))
    reference.no_padding()
    reference.no_truncation()
    encoding = reference.encode("test")
    tokens = _ok(minilm.post("/tokenize", json={"inputs": "test"}))
    assert [t["id"] for t in tokens[0]] == encoding.ids
    word = next(t for t in tokens[0] if not t["special"])
    assert word == {"id": encoding.ids[1], "text": "test", "special": False, "start": 0, "stop": 4}
    assert _ok(minilm.post("/decode", json={"ids": encoding.ids})) == ["test"]
    assert "x-compute-time" not in minilm.post("/decode", json={"ids": encoding.ids}).headers


def test_default_truncation_and_dimensions(minilm: TestClient, st_model: Any) -> None:
    from sentence_transformers import SentenceTransformer

    long_text = "word " * 600  # above MiniLM's 512 positions: truncated unless `truncate: false`
    cut = _ok(minilm.post("/embed", json={"inputs": long_text}))
    _close(cut, st_model.encode([long_text], normalize_embeddings=True))
    # `dimensions` on a model without Matryoshka: TEI cuts the pooled vector, then normalizes
    pooled = SentenceTransformer(modules=[st_model[0], st_model[1]], device="cpu")
    raw = pooled.encode(TOUR_EMBED_BATCH["inputs"])[:, :100]
    want = raw / np.linalg.norm(raw.astype(np.float64), axis=1, keepdims=True)
    body = {**TOUR_EMBED_BATCH, "dimensions": 100}
    _close(_ok(minilm.post("/embed", json=body)), want.astype(np.float32))
    _close(_ok(minilm.post("/embed", json={**body, "normalize": False})), raw)
    for bad in (0, -1, 385):
        response = minilm.post("/embed", json={**README_EMBED, "dimensions": bad})
        assert "dimensions" in _tei_error(response, 422, "Validation")


def test_token_ids_and_batches_mixing_texts_and_ids(minilm: TestClient, st_model: Any) -> None:
    texts = TOUR_EMBED_BATCH["inputs"]
    ids = st_model.tokenizer(texts[1])["input_ids"]
    mixed = minilm.post("/embed", json={"inputs": [texts[0], ids]})
    _close(_ok(mixed), st_model.encode(texts, normalize_embeddings=True))
    # TEI counts one character per token id
    assert int(mixed.headers["x-compute-characters"]) == len(texts[0]) + len(ids)
    reversed_ = _ok(minilm.post("/embed", json={"inputs": [ids, texts[0]]}))
    _close(reversed_, st_model.encode(texts[::-1], normalize_embeddings=True))


@pytest.fixture(scope="module")
def prompted_dir(
    tiny_model_dir: Callable[[str], Path], tmp_path_factory: pytest.TempPathFactory
) -> Path:
    """A tiny BERT as sentence-transformers saves it, whose config names a default prompt."""
    directory = tmp_path_factory.mktemp("tei_prompts") / "prompted"
    shutil.copytree(tiny_model_dir("bert"), directory)
    write_st_modules(directory, max_seq_length=None, do_lower_case=False)
    config = {"prompts": PROMPTS, "default_prompt_name": "query"}
    (directory / "config_sentence_transformers.json").write_text(json.dumps(config))
    return directory


def test_prompts_come_from_the_request_or_the_flag_never_the_model(prompted_dir: Path) -> None:
    from sentence_transformers import SentenceTransformer

    st = SentenceTransformer(str(prompted_dir), device="cpu")
    texts = TOUR_EMBED_BATCH["inputs"]
    ids = st.tokenizer(texts[1])["input_ids"]  # with [CLS]/[SEP]: TEI skips them when prompted
    with _serve(prompted_dir) as client:
        # TEI applies no prompt without prompt_name: the model's default_prompt_name is not read
        plain = _ok(client.post("/embed", json={"inputs": texts}))
        _close(plain, st.encode(texts, prompt_name="empty", normalize_embeddings=True))
        named = client.post("/embed", json={"inputs": [texts[0], ids], "prompt_name": "passage"})
        _close(_ok(named), st.encode(texts, prompt_name="passage", normalize_embeddings=True))
        assert int(named.headers["x-compute-characters"]) == len(texts[0]) + len(ids)
        tokens = _ok(client.post("/tokenize", json={"inputs": "test"}))[0]
        assert [t["text"] for t in tokens][1] == "test"  # no "query: " in front
        unknown = client.post("/embed", json={**README_EMBED, "prompt_name": "nope"})
        _tei_error(unknown, 422, "Validation")
    with _serve(prompted_dir, default_prompt_name="passage") as flagged:
        got = _ok(flagged.post("/embed", json={"inputs": texts}))
        _close(got, st.encode(texts, prompt_name="passage", normalize_embeddings=True))


def _nli_dir(directory: Path) -> Path:
    """A 3-label BERT classifier with named labels (an NLI cross-encoder's shape)."""
    spec = TINY_ENCODERS["bert_cls"]
    torch.manual_seed(5)
    config = getattr(transformers, spec.config_class)(
        **{**spec.config, "num_labels": 3, "id2label": LABELS}
    )
    model = getattr(transformers, spec.hf_class)(config)
    _perturb(model, 5)
    return save_tiny_encoder("bert_cls", directory, model.eval())


def _logits(directory: Path, *texts: str) -> np.ndarray:
    tokenizer = transformers.AutoTokenizer.from_pretrained(directory)
    model = transformers.AutoModelForSequenceClassification.from_pretrained(directory).eval()
    with torch.inference_mode():
        return model(**tokenizer(*texts, return_tensors="pt")).logits[0].numpy()


def _check_predictions(got: list[dict[str, Any]], logits: np.ndarray) -> None:
    scores = torch.softmax(torch.from_numpy(logits), -1).numpy()
    assert [set(p) for p in got] == [{"score", "label"}] * 3
    assert [p["score"] for p in got] == sorted((p["score"] for p in got), reverse=True)
    by_label = {p["label"]: p["score"] for p in got}
    _close([by_label[LABELS[i]] for i in range(3)], scores)


def test_readme_predict_bodies(tmp_path: Path) -> None:
    directory = _nli_dir(tmp_path / "nli")
    with _serve(directory) as client:
        single = client.post("/predict", json=README_PREDICT)
        batch = _ok(client.post("/predict", json=TOUR_PREDICT_BATCH))
        info = _ok(client.get("/info"))
        overlong = client.post("/predict", json={"inputs": [["a"]] * 2049})
    _check_predictions(_ok(single), _logits(directory, README_PREDICT["inputs"]))
    _timings(single, len(README_PREDICT["inputs"]), int(single.headers["x-compute-tokens"]))
    assert len(batch) == 2
    for (text,), got in zip(TOUR_PREDICT_BATCH["inputs"], batch, strict=True):
        _check_predictions(got, _logits(directory, text))
    assert list(info["model_type"]) == ["classifier"]
    _tei_error(overlong, 422, "Validation")  # TEI's batch-size error


def test_readme_rerank_bodies(tmp_path: Path) -> None:
    directory = save_cross_encoder("bert_cls", tmp_path / "ce")
    model = build_cross_encoder("bert_cls")
    tokenizer = transformers.AutoTokenizer.from_pretrained(directory)
    query, texts = README_RERANK["query"], README_RERANK["texts"]
    with torch.inference_mode():
        logits = [model(**tokenizer(query, t, return_tensors="pt")).logits[0, 0] for t in texts]
    want = torch.sigmoid(torch.stack(logits)).numpy()
    with _serve(directory) as client:
        for body in (README_RERANK, TOUR_RERANK):
            response = client.post("/rerank", json=body)
            ranks = _ok(response)
            assert [set(r) for r in ranks] == [{"index", "score"}] * 2
            assert [r["index"] for r in ranks] == list(np.argsort(-want))
            _close([r["score"] for r in sorted(ranks, key=lambda r: r["index"])], want)
            chars = len(query) * len(texts) + sum(len(t) for t in texts)
            assert int(response.headers["x-compute-characters"]) == chars
        assert _ok(client.post("/", json=README_RERANK)) == ranks
        _tei_error(client.post("/rerank", json={"query": "q", "texts": []}), 400, "Empty")
        assert list(_ok(client.get("/info"))["model_type"]) == ["reranker"]


def _sparse_reference(ids: list[int]) -> np.ndarray:
    """transformers' MLM logits -> log1p(relu) -> max over the non-special tokens."""
    skipped = set(SPECIAL_TOKENS.values()) - {SPECIAL_TOKENS["[UNK]"]}
    with torch.no_grad():
        logits = build_hf_encoder("bert_mlm")(input_ids=torch.tensor([ids])).logits[0]
    kept = [i for i, token in enumerate(ids) if token not in skipped]
    return torch.log1p(torch.relu(logits[kept])).amax(dim=0).numpy()


def test_readme_embed_sparse_and_root_on_splade(tmp_path_factory: pytest.TempPathFactory) -> None:
    directory = encoder_dirs(tmp_path_factory)("bert_mlm")
    tokenizer = transformers.AutoTokenizer.from_pretrained(directory)
    with _serve(directory, max_model_len=24) as client:
        response = client.post("/embed_sparse", json=README_EMBED_SPARSE)
        (entries,) = _ok(response)
        # POST / of a SPLADE model is /embed_sparse, as TEI's `--pooling splade` routes it
        assert _ok(client.post("/", json=README_EMBED_SPARSE)) == [entries]
        assert _ok(client.get("/info"))["model_type"] == {"embedding": {"pooling": "splade"}}
        long_text = " ".join(f"term{i}" for i in range(40))  # above max_model_len 24
        unset = _ok(client.post("/embed_sparse", json={"inputs": long_text}))
        cut = _ok(client.post("/embed_sparse", json={"inputs": long_text, "truncate": True}))
        refused = client.post("/embed_sparse", json={"inputs": long_text, "truncate": False})
    assert all(set(e) == {"index", "value"} for e in entries)
    indices = [e["index"] for e in entries]
    assert indices == sorted(indices)
    dense = np.zeros(VOCAB_SIZE, dtype=np.float32)
    dense[indices] = [e["value"] for e in entries]
    ids = tokenizer(README_EMBED_SPARSE["inputs"])["input_ids"]
    _close(dense, _sparse_reference(ids))
    _timings(response, len(README_EMBED_SPARSE["inputs"]), len(ids))
    assert unset == cut  # TEI >= 1.9 truncates unless told not to
    _tei_error(refused, 422, "Validation")


@pytest.mark.parametrize(
    "name,pooling",
    [("bert", "cls"), ("llama", "last_token")],
)
def test_info_names_pooling_as_tei(
    tiny_model_dir: Callable[[str], Path], name: str, pooling: str
) -> None:
    with _serve(tiny_model_dir(name)) as client:
        info = _ok(client.get("/info"))
    assert info["model_type"] == {"embedding": {"pooling": pooling}}
    assert isinstance(info["tokenization_workers"], int) and info["tokenization_workers"] > 0
    assert info["auto_truncate"] is True


def test_info_minilm_mean(minilm: TestClient) -> None:
    assert _ok(minilm.get("/info"))["model_type"] == {"embedding": {"pooling": "mean"}}


BAD_BODIES = [
    ("/embed", {"inputs": []}, 400, "Empty"),
    ("/embed", {"inputs": ""}, 400, "Empty"),
    ("/embed", {"inputs": ["a", ""]}, 400, "Empty"),
    ("/embed", {"inputs": [[]]}, 400, "Empty"),
    ("/embed", {"inputs": 5}, 422, "Validation"),
    ("/embed", {"inputs": ["a", 5]}, 422, "Validation"),
    ("/embed", {"truncate": True}, 422, "Validation"),
    ("/embed", {"inputs": "a", "truncation_direction": "up"}, 422, "Validation"),
    ("/embed", {"inputs": ["a"] * 2049}, 422, "Validation"),
    ("/embed", {"inputs": [10**6]}, 422, "Validation"),
    ("/embed_all", {"inputs": []}, 400, "Empty"),
    ("/embed_sparse", {"inputs": "a"}, 424, "Backend"),  # not a SPLADE model
    ("/similarity", {"inputs": {"source_sentence": "a", "sentences": []}}, 400, "Empty"),
    ("/similarity", {"inputs": {"source_sentence": "a"}}, 422, "Validation"),
    ("/predict", README_PREDICT, 424, "Backend"),  # not a classifier
    ("/predict", {"inputs": ["a", "b", "c"]}, 422, "Validation"),
    ("/tokenize", {"inputs": []}, 400, "Empty"),
    ("/tokenize", {"inputs": ""}, 400, "Empty"),
    ("/decode", {"ids": []}, 400, "Empty"),
    ("/decode", {"ids": "x"}, 422, "Validation"),
    ("/rerank", {"query": "q", "texts": []}, 400, "Empty"),
    ("/", {"inputs": 5}, 422, "Validation"),
    ("/", [1, 2], 422, "Validation"),
]


@pytest.mark.parametrize("path,body,status,error_type", BAD_BODIES)
def test_bad_input_is_a_tei_shaped_4xx(
    minilm: TestClient, path: str, body: Any, status: int, error_type: str
) -> None:
    _tei_error(minilm.post(path, json=body), status, error_type)


@pytest.mark.parametrize("path", ["/embed", "/"])
def test_framing_errors_are_tei_shaped(minilm: TestClient, path: str) -> None:
    headers = {"content-type": "application/json"}
    syntax = minilm.post(path, content=b'{"inputs": ', headers=headers)
    _tei_error(syntax, 400, "Validation")  # axum: a JSON syntax error is a 400
    twice = minilm.post(path, content=b'{"inputs": "a", "inputs": "b"}', headers=headers)
    _tei_error(twice, 422, "Validation")  # serde: a duplicate field is a data error


def test_native_routes_keep_their_error_body(minilm: TestClient) -> None:
    error = minilm.post("/v1/embeddings", json={"input": []}).json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    vllm = minilm.post("/tokenize", json={"prompt": 5}).json()["error"]
    assert set(vllm) == {"message", "type", "param", "code"}


def test_overloaded_and_unhealthy_are_tei_shaped(minilm: TestClient) -> None:
    if not isinstance(minilm, TestClient):
        pytest.skip("sets the in-process app's state")
    state = minilm.app.state.poolserve
    full = state.settings.max_num_queued_requests
    with queue_taken(minilm, full, 1):
        response = minilm.post("/embed", json=README_EMBED)
        _tei_error(response, 429, "Overloaded")
        assert int(response.headers["retry-after"]) >= 1
    state.draining = True
    try:
        _tei_error(minilm.post("/embed", json=README_EMBED), 503, "Unhealthy")
        _tei_error(minilm.post("/rerank", json=README_RERANK), 503, "Unhealthy")
    finally:
        state.draining = False
    assert minilm.post("/embed", json=README_EMBED).status_code == 200
