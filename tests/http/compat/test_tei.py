"""TEI's documented request bodies on every TEI route, answered in TEI's shapes, field by field.

References: sentence-transformers and transformers for the numbers, the `tokenizers` library
(which TEI runs) for tokens, offsets and decoding.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
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
from tests.tiny_encoders import TINY_ENCODERS, _perturb, save_tiny_encoder
from tests.tiny_rerankers import build_cross_encoder, save_cross_encoder

LABELS = {0: "contradiction", 1: "entailment", 2: "neutral"}
TEXTS = ["Today is a nice day", "I like you"]


def _close(got: object, want: np.ndarray) -> None:
    arr = np.asarray(got, dtype=np.float32)
    assert arr.shape == want.shape, (arr.shape, want.shape)
    assert float(np.abs(arr - want).max()) <= 1e-4 * max(float(np.abs(want).max()), 1e-6)


@pytest.fixture(scope="module")
def minilm(make_client: Callable[..., Any]) -> Iterator[TestClient]:
    with make_client(None) as client:
        yield client


@pytest.fixture(scope="module")
def st_model(minilm_dir: Path) -> Any:
    from sentence_transformers import SentenceTransformer

    return SentenceTransformer(str(minilm_dir), device="cpu")


def _ok(response: Any) -> Any:
    assert response.status_code == 200, response.text
    assert response.headers["content-type"] == "application/json"
    return response.json()


def test_embed_documented_bodies(minilm: TestClient, st_model: Any) -> None:
    # README: {"inputs":"What is Deep Learning?"}; quick tour: a batch of two
    single = _ok(minilm.post("/embed", json={"inputs": "What is Deep Learning?"}))
    _close(single, st_model.encode(["What is Deep Learning?"], normalize_embeddings=True))
    batch = _ok(minilm.post("/embed", json={"inputs": TEXTS}))
    _close(batch, st_model.encode(TEXTS, normalize_embeddings=True))
    from sentence_transformers import SentenceTransformer

    # normalize false: the pooled mean without the Normalize module, as TEI leaves it
    pooled = SentenceTransformer(modules=[st_model[0], st_model[1]], device="cpu")
    raw = _ok(minilm.post("/embed", json={"inputs": TEXTS, "normalize": False}))
    _close(raw, pooled.encode(TEXTS))
    # POST / is the embedding model's /embed, as TEI routes it
    _close(_ok(minilm.post("/", json={"inputs": TEXTS})), np.asarray(batch, dtype=np.float32))


def test_embed_truncation(minilm: TestClient, st_model: Any) -> None:
    long_text = "word " * 600  # past MiniLM's 512 positions
    want = st_model.encode([long_text], normalize_embeddings=True)
    # sentence_bert_config.json's max_seq_length (256) is TEI's max_input_length: truncate
    # (TEI >= 1.9's default) cuts there as sentence-transformers does, false refuses
    for truncate in (True, None):
        kept = _ok(minilm.post("/embed", json={"inputs": long_text, "truncate": truncate}))
        _close(kept, want)
    refused = minilm.post("/embed", json={"inputs": long_text, "truncate": False})
    assert refused.status_code == 422, refused.text
    assert refused.json()["error_type"] == "Validation" and "256" in refused.json()["error"]
    # truncation_direction: left keeps the end, as tokenizers' Left does
    tail = "alpha " * 300 + "beta gamma delta"
    left = minilm.post(
        "/embed", json={"inputs": tail, "truncate": True, "truncation_direction": "Left"}
    )
    right = minilm.post("/embed", json={"inputs": tail, "truncate": True})
    assert _ok(left) != _ok(right)


def test_token_id_inputs(minilm: TestClient, st_model: Any) -> None:
    ids = st_model.tokenizer(TEXTS[0])["input_ids"]
    got = _ok(minilm.post("/embed", json={"inputs": ids}))
    _close(got, st_model.encode(TEXTS[:1], normalize_embeddings=True))


def test_embed_all_equals_transformers_hidden_states(minilm: TestClient, minilm_dir: Path) -> None:
    got = _ok(minilm.post("/embed_all", json={"inputs": TEXTS}))
    tokenizer = transformers.AutoTokenizer.from_pretrained(minilm_dir)
    model = transformers.AutoModel.from_pretrained(minilm_dir).eval()
    assert len(got) == len(TEXTS)
    for text, rows in zip(TEXTS, got, strict=True):
        with torch.inference_mode():
            hidden = model(**tokenizer(text, return_tensors="pt")).last_hidden_state[0]
        _close(rows, hidden.numpy())  # [num_tokens, 384], not normalized


def test_similarity_and_root_with_a_similarity_body(minilm: TestClient, st_model: Any) -> None:
    # the openapi example: source_sentence and sentences
    body = {
        "inputs": {
            "source_sentence": "What is Deep Learning?",
            "sentences": ["What is Machine Learning?", "Today is a nice day"],
        }
    }
    vectors = st_model.encode([body["inputs"]["source_sentence"], *body["inputs"]["sentences"]])
    want = st_model.similarity(vectors[:1], vectors[1:]).numpy()[0]
    _close(_ok(minilm.post("/similarity", json=body)), want)
    _close(_ok(minilm.post("/", json={**body, "parameters": {}})), want)
    empty = {"inputs": {"source_sentence": "a", "sentences": []}}
    assert minilm.post("/similarity", json=empty).status_code == 400


def _tokenizer(minilm_dir: Path) -> Tokenizer:
    """The tokenizers library over MiniLM's tokenizer.json, without its padding (as TEI runs it)."""
    tokenizer = Tokenizer.from_file(str(minilm_dir / "tokenizer.json"))
    tokenizer.no_padding()
    tokenizer.no_truncation()
    return tokenizer


def test_tokenize_token_objects(minilm: TestClient, minilm_dir: Path) -> None:
    reference = _tokenizer(minilm_dir)
    # the openapi example body, then a batch with non-ASCII text (offsets are UTF-8 bytes)
    texts = ["test", "Café naïve 東京 tokens"]
    answers = [_ok(minilm.post("/tokenize", json={"inputs": "test", "add_special_tokens": True}))]
    answers.append(_ok(minilm.post("/tokenize", json={"inputs": texts})))
    assert len(answers[0]) == 1 and len(answers[1]) == 2
    for text, tokens in zip([texts[0], *texts], [*answers[0], *answers[1]], strict=True):
        encoding = reference.encode(text, add_special_tokens=True)
        assert [t["id"] for t in tokens] == encoding.ids
        data = text.encode("utf-8")
        for token, special, name in zip(
            tokens, encoding.special_tokens_mask, encoding.tokens, strict=True
        ):
            assert set(token) == {"id", "text", "special", "start", "stop"}
            assert token["special"] is bool(special)
            if special:
                assert (token["text"], token["start"], token["stop"]) == (name, None, None)
            else:
                piece = data[token["start"] : token["stop"]].decode("utf-8")
                assert token["text"] == piece
                assert piece.lower().replace("ï", "i").replace("é", "e")  # a real slice
    plain = _ok(minilm.post("/tokenize", json={"inputs": "test", "add_special_tokens": False}))
    assert [t["id"] for t in plain[0]] == reference.encode("test", add_special_tokens=False).ids
    # vLLM's body on the same path keeps its own answer
    vllm = _ok(minilm.post("/tokenize", json={"prompt": "test"}))
    assert vllm["tokens"] == reference.encode("test").ids
    assert minilm.post("/tokenize", json={"inputs": []}).status_code == 400


def test_decode(minilm: TestClient, minilm_dir: Path) -> None:
    reference = _tokenizer(minilm_dir)
    ids = reference.encode("Hello, World! it's a test").ids
    assert _ok(minilm.post("/decode", json={"ids": ids})) == [reference.decode(ids)]
    both = _ok(minilm.post("/decode", json={"ids": [ids, ids[:3]], "skip_special_tokens": False}))
    assert both == [reference.decode(i, skip_special_tokens=False) for i in (ids, ids[:3])]
    # TEI's statuses: 422 (Validation) for an id outside the vocabulary and for a batch above
    # --max-client-batch-size
    assert minilm.post("/decode", json={"ids": [10**6]}).status_code == 422
    assert minilm.post("/decode", json={"ids": [[1], [1, 2]] * 2000}).status_code == 422


def test_info_has_tei_fields_and_keeps_its_own(minilm: TestClient) -> None:
    info = _ok(minilm.get("/info"))
    own = {"model", "model_source", "architecture", "tasks", "dtype", "max_model_len", "version"}
    assert own <= set(info)
    assert info["model_id"] == "sentence-transformers/all-MiniLM-L6-v2"
    assert info["served_model_name"] == "minilm"
    assert info["model_dtype"] == "float32"
    assert info["model_type"] == {"embedding": {"pooling": "mean"}}
    assert info["max_input_length"] == 256  # sentence_bert_config.json's max_seq_length
    # TEI's routes truncate when a request leaves `truncate` unset (TEI >= 1.9's default)
    assert info["max_client_batch_size"] == 2048 and info["auto_truncate"] is True
    for key in ("max_concurrent_requests", "max_batch_tokens", "max_batch_requests", "model_sha"):
        assert key in info
    assert info["similarity_fn_name"] == "cosine" and info["prompts"] == {}


def test_unknown_fields_are_ignored_as_tei_does(minilm: TestClient) -> None:
    body = {"inputs": "x", "encoding_format": "float", "parameters": {}}
    assert minilm.post("/embed", json=body).status_code == 200
    assert minilm.post("/embed", json={"inputs": []}).status_code == 400
    assert minilm.post("/predict", json={"inputs": "x"}).status_code == 424  # no classifier


def _nli_dir(directory: Path) -> Path:
    """A 3-label BERT classifier with named labels (an NLI cross-encoder's shape)."""
    spec = TINY_ENCODERS["bert_cls"]
    torch.manual_seed(3)
    config = getattr(transformers, spec.config_class)(
        **{**spec.config, "num_labels": 3, "id2label": LABELS}
    )
    model = getattr(transformers, spec.hf_class)(config)
    _perturb(model, 3)
    return save_tiny_encoder("bert_cls", directory, model.eval())


@pytest.fixture(scope="module")
def nli(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[TestClient, Path]]:
    directory = _nli_dir(tmp_path_factory.mktemp("nli"))
    with TestClient(create_app(ServerSettings(model=str(directory)))) as client:
        yield client, directory


def _logits(directory: Path, *texts: str) -> np.ndarray:
    tokenizer = transformers.AutoTokenizer.from_pretrained(directory)
    model = transformers.AutoModelForSequenceClassification.from_pretrained(directory).eval()
    with torch.inference_mode():
        return model(**tokenizer(*texts, return_tensors="pt")).logits[0].numpy()


def _check_predictions(got: list[dict[str, Any]], logits: np.ndarray, raw: bool) -> None:
    """TEI's list: every label once, best first, the softmax (or the raw logit) as score."""
    scores = logits if raw else torch.softmax(torch.from_numpy(logits), -1).numpy()
    assert [set(p) for p in got] == [{"score", "label"}] * 3
    assert [p["score"] for p in got] == sorted((p["score"] for p in got), reverse=True)
    by_label = {p["label"]: p["score"] for p in got}
    _close([by_label[LABELS[i]] for i in range(3)], scores)


def test_predict_single_pair_and_batch(nli: tuple[TestClient, Path]) -> None:
    client, directory = nli
    # README: {"inputs":"I like you."}
    single = _ok(client.post("/predict", json={"inputs": "I like you."}))
    _check_predictions(single, _logits(directory, "I like you."), raw=False)
    pair = _ok(client.post("/predict", json={"inputs": ["I like you.", "I hate you."]}))
    _check_predictions(pair, _logits(directory, "I like you.", "I hate you."), raw=False)
    # quick tour: {"inputs":[["I like you."], ["I hate pineapples"]]}, plus a pair in the batch
    items = [["I like you."], ["I hate pineapples"], ["I like you.", "I hate you."]]
    batch = _ok(client.post("/predict", json={"inputs": items, "raw_scores": True}))
    assert len(batch) == 3
    for item, got in zip(items, batch, strict=True):
        _check_predictions(got, _logits(directory, *item), raw=True)
    # POST / on a classifier is /predict
    assert _ok(client.post("/", json={"inputs": "I like you."})) == single
    info = _ok(client.get("/info"))
    assert info["model_type"] == {
        "classifier": {
            "id2label": {str(k): v for k, v in LABELS.items()},
            "label2id": {v: k for k, v in LABELS.items()},
        }
    }
    for bad in (["a", "b", "c"], [["a", "b", "c"]], []):  # TEI's serde refusals: 422
        assert client.post("/predict", json={"inputs": bad}).status_code == 422


def test_root_on_a_reranker_takes_tei_rerank_bodies(tmp_path: Path) -> None:
    directory = save_cross_encoder("bert_cls", tmp_path / "ce")
    body = {
        "query": "What is Deep Learning?",
        "texts": ["Deep Learning is not...", "Deep learning is..."],
    }
    with TestClient(create_app(ServerSettings(model=str(directory)))) as client:
        ranked = _ok(client.post("/", json=body))
        assert ranked == _ok(client.post("/rerank", json=body))
        info = _ok(client.get("/info"))
        single = _ok(client.post("/predict", json={"inputs": ["What is Deep Learning?", "x"]}))
    assert list(info["model_type"]) == ["reranker"]
    model = build_cross_encoder("bert_cls")
    tokenizer = transformers.AutoTokenizer.from_pretrained(directory)
    with torch.inference_mode():
        logit = model(**tokenizer("What is Deep Learning?", "x", return_tensors="pt")).logits
    _close([single[0]["score"]], torch.sigmoid(logit[0]).numpy())
