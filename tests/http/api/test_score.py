"""/score: cross-encoders equal sentence-transformers' CrossEncoder, yes/no rows equal the causal
LM's softmax, embedding models equal the cosine of sentence-transformers embeddings."""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from sentence_transformers import CrossEncoder, SentenceTransformer
from starlette.testclient import TestClient
from transformers import AutoTokenizer

from poolserve.config.settings import ServerSettings
from poolserve.engine.bridge import _score_activation
from poolserve.frontend.jobs import ScoreJob
from poolserve.frontend.pairs import PairTruncation, PromptMode, _prompts
from poolserve.http.app import create_app
from poolserve.models.loader import load_model
from poolserve.types.errors import ModelLoadError
from poolserve.types.model_info import ScoreActivation
from tests.tiny_decoders import build_hf_decoder, save_tiny_decoder
from tests.tiny_models import MINILM_DIR, build_hf_model, save_tiny_model
from tests.tiny_rerankers import (
    QWEN3_YES_NO,
    build_cross_encoder,
    save_cross_encoder,
    write_activation,
)

QUERY = "what is the capital of france"
DOCUMENTS = [
    "paris is the capital and largest city of france",
    "the cat sat on the mat",
    "berlin is the capital of germany, a country next to france",
]
# A decoder reranker's prompt as the Qwen3 reranker formats it; the query ends at a line break
QWEN_QUERY = "<Instruct>: judge the document\n<Query>: what is the capital of france\n"
QWEN_DOCUMENTS = [f"<Document>: {d}" for d in DOCUMENTS]


@contextmanager
def serve(model: Path | None, **settings: Any) -> Iterator[TestClient]:
    """A started app serving `model` as "m"."""
    app = create_app(
        ServerSettings(model=str(model) if model else None, served_model_name="m", **settings)
    )
    with TestClient(app) as client:
        yield client


def _scores(client: TestClient, **body: Any) -> list[float]:
    response = client.post("/score", json=body)
    assert response.status_code == 200, response.text
    data = response.json()["data"]
    assert [d["index"] for d in data] == list(range(len(data)))
    return [d["score"] for d in data]


@pytest.fixture(scope="module")
def cross_encoders(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], Path]:
    built: dict[str, Path] = {}

    def get(name: str) -> Path:
        if name not in built:
            built[name] = save_cross_encoder(name, tmp_path_factory.mktemp(name))
        return built[name]

    return get


@pytest.mark.parametrize("name", ["bert_cls", "xlmroberta_cls"])
def test_cross_encoder_equals_sentence_transformers(
    cross_encoders: Callable[[str], Path], name: str
) -> None:
    directory = cross_encoders(name)
    reference = CrossEncoder(str(directory), device="cpu")
    pairs = [(QUERY, d) for d in DOCUMENTS]
    want = reference.predict(pairs)
    raw = reference.predict(pairs, activation_fn=torch.nn.Identity())
    with serve(directory) as client:
        np.testing.assert_allclose(_scores(client, text_1=QUERY, text_2=DOCUMENTS), want, atol=1e-5)
        raw_got = _scores(client, text_1=QUERY, text_2=DOCUMENTS, use_activation=False)
        np.testing.assert_allclose(raw_got, raw, atol=1e-4)
        # N:N pairs each text_1 with its text_2; 1:1 is one pair
        many = [QUERY, "a question about cats", QUERY]
        want_many = reference.predict(list(zip(many, DOCUMENTS, strict=True)))
        np.testing.assert_allclose(
            _scores(client, text_1=many, text_2=DOCUMENTS), want_many, atol=1e-5
        )
        one = _scores(client, text_1=QUERY, text_2=DOCUMENTS[1])
        np.testing.assert_allclose(one, want[1:2], atol=1e-5)


@pytest.mark.parametrize("path", ["/score", "/v1/score"])
def test_score_shape_matches_vllm(cross_encoders: Callable[[str], Path], path: str) -> None:
    with serve(cross_encoders("bert_cls")) as client:
        answer = client.post(path, json={"model": "m", "text_1": QUERY, "text_2": DOCUMENTS})
    assert answer.status_code == 200
    body = answer.json()
    # vLLM's ScoreResponse, its UsageInfo as serialized, and ScoreResponseData
    assert list(body) == ["id", "object", "created", "model", "data", "usage"]
    assert body["id"].startswith("score-") and body["object"] == "list"
    assert isinstance(body["created"], int) and body["model"] == "m"
    assert [list(d) for d in body["data"]] == [["index", "object", "score"]] * len(DOCUMENTS)
    assert all(d["object"] == "score" and isinstance(d["score"], float) for d in body["data"])
    usage = body["usage"]
    assert usage["prompt_tokens"] == usage["total_tokens"] > 0
    assert (usage["completion_tokens"], usage["prompt_tokens_details"]) == (0, None)
    assert float(answer.headers["x-inference-time"]) >= 0


@pytest.mark.parametrize("name", ["bert_cls", "xlmroberta_cls"])
def test_pairs_are_laid_out_as_the_tokenizer_does(
    cross_encoders: Callable[[str], Path], name: str
) -> None:
    directory = cross_encoders(name)
    tokenizer = AutoTokenizer.from_pretrained(directory)
    job = ScoreJob((QUERY,), tuple(DOCUMENTS), ((0, 0), (0, 2)), "text_1", "text_2")
    with serve(directory) as client:
        model = client.app.state.poolserve.model  # type: ignore[attr-defined]
        prompts = _prompts(job, model, PromptMode.TEMPLATE, PairTruncation(None, "right", None))
    for prompt, document in zip(prompts, (DOCUMENTS[0], DOCUMENTS[2]), strict=True):
        encoded = tokenizer(QUERY, document)
        assert prompt.token_ids == encoded["input_ids"]
        # BERT's second segment is type 1; XLM-R's tokenizer gives no types (its table has one)
        assert prompt.token_type_ids == encoded.get("token_type_ids")
    assert (prompts[0].token_type_ids is not None) == (name == "bert_cls")


def test_token_types_change_a_bert_score(cross_encoders: Callable[[str], Path]) -> None:
    model = build_cross_encoder("bert_cls")
    tokenizer = AutoTokenizer.from_pretrained(cross_encoders("bert_cls"))
    encoded = tokenizer(QUERY, DOCUMENTS[0], return_tensors="pt")
    with torch.no_grad():
        typed = model(**encoded).logits[0, 0]
        untyped = model(input_ids=encoded["input_ids"]).logits[0, 0]
    with serve(cross_encoders("bert_cls")) as client:
        (got,) = _scores(client, text_1=QUERY, text_2=DOCUMENTS[0], use_activation=False)
    assert got == pytest.approx(float(typed), abs=1e-4)
    assert abs(float(typed) - float(untyped)) > 1e-3  # the test would catch dropped types


def _yes_no_reference(model: Any, tokenizer: Any, tokens: list[str]) -> tuple[list[float], ...]:
    """softmax over the LM head's rows of the tokens, and their difference, at the last position."""
    ids = [tokenizer.convert_tokens_to_ids(t) for t in tokens]
    probs, raws = [], []
    for document in QWEN_DOCUMENTS:
        prompt = tokenizer(QWEN_QUERY + document, return_tensors="pt")["input_ids"]
        with torch.no_grad():
            logits = model(input_ids=prompt).logits[0, -1, ids]  # [len(tokens)]
        probs.append(float(torch.softmax(logits, -1)[-1]))
        raws.append(float(logits[-1] - logits[0]) if len(ids) == 2 else float(logits[0]))
    return probs, raws


@pytest.mark.parametrize(
    ("name", "overrides"),
    [
        ("qwen3", QWEN3_YES_NO),
        # Gemma 2's final soft-capping applies to the two logits, as in transformers
        (
            "gemma2",
            {
                "architectures": ["Gemma2ForSequenceClassification"],
                "classifier_from_token": ["no", "yes"],
                "method": "from_2_way_softmax",
            },
        ),
    ],
)
def test_yes_no_reranker_equals_the_causal_lm(
    tmp_path: Path, name: str, overrides: dict[str, object]
) -> None:
    if name == "qwen3":
        directory, model = _qwen3(tmp_path)
    else:
        directory, model = save_tiny_decoder(name, tmp_path), build_hf_decoder(name)
    tokenizer = AutoTokenizer.from_pretrained(directory)
    probs, raws = _yes_no_reference(model, tokenizer, ["no", "yes"])
    # the texts come formatted (vLLM's example): no score template (Qwen3-Reranker has one)
    with serve(directory, hf_overrides=json.dumps(overrides), score_template="none") as client:
        got = _scores(client, text_1=QWEN_QUERY, text_2=QWEN_DOCUMENTS)
        raw = _scores(client, text_1=QWEN_QUERY, text_2=QWEN_DOCUMENTS, use_activation=False)
        info = client.get("/info").json()
    np.testing.assert_allclose(got, probs, atol=1e-5)
    np.testing.assert_allclose(raw, raws, atol=1e-4 * max(map(abs, raws)))
    assert "score" in info["tasks"]


@pytest.mark.parametrize("use_sep_token", [None, False])
def test_decoder_cross_encoder_pairs_follow_vllms_use_sep_token(
    tmp_path: Path, use_sep_token: bool | None
) -> None:
    # vLLM lays a pair out as tokenizer(query, document) unless the config says use_sep_token:
    # false, then it scores tokenizer(query + document); a decoder takes no token type ids
    directory, model = save_tiny_model("llama_cls1", tmp_path), build_hf_model("llama_cls1")
    tokenizer = AutoTokenizer.from_pretrained(directory)
    want = []
    for document in DOCUMENTS:
        pair = (QUERY, document) if use_sep_token is None else (QUERY + document,)
        ids = tokenizer(*pair, return_tensors="pt")["input_ids"]
        with torch.no_grad():
            want.append(float(model(input_ids=ids).logits[0, 0]))
    overrides = {} if use_sep_token is None else {"use_sep_token": use_sep_token}
    with serve(directory, hf_overrides=json.dumps(overrides)) as client:
        got = _scores(client, text_1=QUERY, text_2=DOCUMENTS, use_activation=False)
    np.testing.assert_allclose(got, want, atol=1e-4 * max(map(abs, want)))


def _qwen3(tmp_path: Path) -> tuple[Path, Any]:
    return save_tiny_model("qwen3", tmp_path), build_hf_model("qwen3")


def test_no_post_processing_scores_one_token_row(tmp_path: Path) -> None:
    directory, model = _qwen3(tmp_path)
    tokenizer = AutoTokenizer.from_pretrained(directory)
    _, raws = _yes_no_reference(model, tokenizer, ["yes"])
    overrides = {
        "architectures": ["Qwen3ForSequenceClassification"],
        "classifier_from_token": ["yes"],
        "method": "no_post_processing",
    }
    with serve(directory, hf_overrides=json.dumps(overrides)) as client:
        got = _scores(client, text_1=QWEN_QUERY, text_2=QWEN_DOCUMENTS)
    np.testing.assert_allclose(got, torch.sigmoid(torch.tensor(raws)).numpy(), atol=1e-5)


def test_yes_no_head_keeps_only_the_token_rows(tmp_path: Path) -> None:
    directory, _ = _qwen3(tmp_path)
    loaded = load_model(str(directory), device=torch.device("cpu"), hf_overrides=QWEN3_YES_NO)
    assert loaded.spec.architecture == "Qwen3ForSequenceClassification"
    assert loaded.spec.num_labels == 1
    head = loaded.head
    assert head is not None
    assert sum(p.numel() for p in head.parameters()) == 2 * loaded.spec.hidden_size + 2


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({**QWEN3_YES_NO, "classifier_from_token": ["yes"]}, "a list of 2 tokens"),
        ({**QWEN3_YES_NO, "classifier_from_token": ["no", "zzzqqq"]}, "not in the vocabulary"),
        ({**QWEN3_YES_NO, "method": "from_3_way"}, "not supported"),
        ({**QWEN3_YES_NO, "architectures": ["Qwen3ForCausalLM"]}, "ForSequenceClassification"),
    ],
)
def test_bad_overrides_are_refused_at_load(
    tmp_path: Path, overrides: dict[str, object], message: str
) -> None:
    directory, _ = _qwen3(tmp_path)
    with pytest.raises(ModelLoadError, match=message):
        load_model(str(directory), device=torch.device("cpu"), hf_overrides=overrides)


def test_hf_overrides_must_be_a_json_object() -> None:
    with pytest.raises(ValueError, match="JSON object"):
        ServerSettings(hf_overrides="[1, 2]")


def test_embedding_model_scores_by_cosine_as_sentence_transformers() -> None:
    reference = SentenceTransformer(str(MINILM_DIR), device="cpu")
    query = reference.encode([QUERY], convert_to_tensor=True)
    docs = reference.encode(DOCUMENTS, convert_to_tensor=True)
    want = torch.nn.functional.cosine_similarity(query, docs).numpy()
    firsts = [QUERY, DOCUMENTS[1], QUERY]
    firsts_emb = reference.encode(firsts, convert_to_tensor=True)
    want_many = torch.nn.functional.cosine_similarity(firsts_emb, docs).numpy()
    with serve(None) as client:
        np.testing.assert_allclose(_scores(client, text_1=QUERY, text_2=DOCUMENTS), want, atol=1e-5)
        many = _scores(client, text_1=firsts, text_2=DOCUMENTS)
        np.testing.assert_allclose(many, want_many, atol=1e-5)


@pytest.mark.parametrize(
    ("where", "path", "expected"),
    [
        ("config_sentence_transformers.json", "torch.nn.modules.linear.Identity", "identity"),
        ("sentence_transformers", "torch.nn.modules.activation.Tanh", "tanh"),
        ("sbert_ce_default_activation_function", "torch.nn.modules.linear.Identity", "identity"),
        ("sbert_ce_default_activation_function", "my_package.Custom", "sigmoid"),
    ],
)
def test_saved_cross_encoder_activation_is_read(
    tmp_path: Path, where: str, path: str, expected: str
) -> None:
    directory = save_cross_encoder("bert_cls", tmp_path)
    assert _score_activation(directory) is ScoreActivation.SIGMOID
    write_activation(directory, where, path)
    assert _score_activation(directory) is ScoreActivation(expected)


def test_unknown_torch_activation_is_refused(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text("{}")
    write_activation(tmp_path, "sentence_transformers", "torch.nn.modules.activation.Softmax")
    with pytest.raises(ModelLoadError, match="Softmax"):
        _score_activation(tmp_path)


def test_saved_identity_activation_gives_raw_scores_as_sentence_transformers(
    tmp_path: Path,
) -> None:
    directory = save_cross_encoder("bert_cls", tmp_path)
    write_activation(
        directory, "config_sentence_transformers.json", "torch.nn.modules.linear.Identity"
    )
    want = CrossEncoder(str(directory), device="cpu").predict([(QUERY, d) for d in DOCUMENTS])
    assert (want < 0).any() or (want > 1).any()  # raw logits, not probabilities
    with serve(directory) as client:
        np.testing.assert_allclose(_scores(client, text_1=QUERY, text_2=DOCUMENTS), want, atol=1e-4)


def test_truncation_cuts_the_document_first(cross_encoders: Callable[[str], Path]) -> None:
    directory = cross_encoders("bert_cls")
    tokenizer = AutoTokenizer.from_pretrained(directory)
    long_document = " ".join(DOCUMENTS * 20)
    keep = 24
    encoded = tokenizer(
        QUERY, long_document, truncation="only_second", max_length=keep, return_tensors="pt"
    )
    with torch.no_grad():
        want = float(build_cross_encoder("bert_cls")(**encoded).logits[0, 0])
    with serve(directory, max_model_len=64) as client:
        refused = client.post("/score", json={"text_1": QUERY, "text_2": long_document})
        body = {"text_1": QUERY, "text_2": long_document, "truncate_prompt_tokens": keep}
        (got,) = _scores(client, **body, use_activation=False)
    assert refused.status_code == 400
    assert refused.json()["error"]["param"] == "text_2"
    assert refused.json()["error"]["code"] == "context_length_exceeded"
    assert got == pytest.approx(want, abs=1e-4)


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"text_1": ["a", "b"], "text_2": ["c", "d", "e"]}, "text_2"),
        ({"text_1": "a", "text_2": []}, "text_2"),
        ({"text_1": [], "text_2": "b"}, "text_1"),
        ({"text_1": "a", "text_2": ["b", ""]}, "text_2"),
        ({"text_1": "a", "text_2": "b", "truncate_prompt_tokens": 3}, "truncate_prompt_tokens"),
        ({"text_1": "a", "text_2": ["b"] * 9}, "text_2"),
    ],
)
def test_score_refusals_name_the_field(
    cross_encoders: Callable[[str], Path], body: dict[str, object], param: str
) -> None:
    with serve(cross_encoders("bert_cls"), max_client_batch_size=8) as client:
        response = client.post("/score", json=body)
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == param


@pytest.mark.parametrize(
    ("name", "served"), [("qwen2_tokcls", "token_classify"), ("llama_cls3", "classify")]
)
def test_a_model_without_a_scorer_names_its_tasks(
    make_client: Callable[..., Any], name: str, served: str
) -> None:
    # vLLM registers no score route for such a model: 404, here with the tasks it serves
    with make_client(name) as client:
        for path, body in (
            ("/score", {"text_1": "a", "text_2": "b"}),
            ("/v1/rerank", {"query": "a", "documents": ["b"]}),
            ("/rerank", {"query": "a", "documents": ["b"]}),
        ):
            response = client.post(path, json=body)
            assert response.status_code == 404, path
            error = response.json()["error"]
            assert error["code"] == "unsupported_task"
            assert served in error["message"] and "'score'" in error["message"]


def test_pair_template_probe_finds_the_tokenizers_layout(tiny_model_dir: Any) -> None:
    """The layout probed once at start lays out pairs exactly as tokenizer(a, b) does."""
    from transformers import AutoTokenizer

    from poolserve.frontend.pair_template import probe_pair_template

    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir("bert"))
    layout = probe_pair_template(tokenizer)
    assert layout is not None
    for first, second in (("a query", "some document text"), ("x", "y z w")):
        want = tokenizer(first, second)
        got = layout.join(
            tokenizer(first, add_special_tokens=False)["input_ids"],
            tokenizer(second, add_special_tokens=False)["input_ids"],
        )
        assert got.token_ids == want["input_ids"]
        assert got.token_type_ids == want["token_type_ids"]
