"""EuroBERT's heads: the sequence classifier (bos, mean and late pooling), the token classifier
and the MLM head (sparse embeddings), equal to transformers over packed prompts, and served."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
import torch
import transformers
from starlette.testclient import TestClient
from transformers import AutoTokenizer

from poolserve.config.settings import ServerSettings
from poolserve.engine.bridge import pooling_info_from
from poolserve.http.app import create_app
from poolserve.models import load_model
from poolserve.types.errors import ModelLoadError
from poolserve.types.tasks import HeadKind, PoolingTask, PoolingType
from tests.models.driver import assert_close, make_prompts
from tests.models.test_encoder_families import run_packed
from tests.models.test_eurobert import EUROBERT
from tests.tiny_decoders import _perturb
from tests.tiny_models import SPECIAL_TOKENS, write_tokenizer

CPU = torch.device("cpu")
LENGTHS = (1, 5, 37, 130, 300)
# float32 throughout: measured <= 2.4e-6 relative; a pooling or mask mistake is far above this
REL = 1e-5
# transformers' classifier_pooling -> the pooling poolserve runs before the head
SEQUENCE_POOLINGS = {"bos": PoolingType.CLS, "mean": PoolingType.MEAN, "late": PoolingType.ALL}
REDUCE = {
    PoolingType.CLS: lambda x: x[0],
    PoolingType.MEAN: lambda x: x.mean(dim=0),
    PoolingType.ALL: lambda x: x,
}
TEXTS = ["hello world", "x", "a longer sentence about european languages " * 8]
QUERY = "what is the capital of france"
DOCUMENTS = ["paris is the capital of france", "bananas are yellow", "berlin " * 20]
# what sparse pooling skips: the tokenizer's specials except UNK
SKIPPED = frozenset(SPECIAL_TOKENS.values()) - {SPECIAL_TOKENS["[UNK]"]}


def build(class_name: str, seed: int = 0, **overrides: Any) -> Any:
    """A random-weight EuroBERT head model (float32, eager), norms and biases perturbed."""
    torch.manual_seed(seed)
    config = transformers.EuroBertConfig(**{**EUROBERT, **overrides})
    config._attn_implementation = "eager"
    model = getattr(transformers, class_name)(config)
    _perturb(model, seed)
    return model.eval()


def save(model: Any, path: Path) -> Path:
    model.save_pretrained(path)
    write_tokenizer(path)
    return path


def padded_logits(model: Any, prompts: list[list[int]]) -> list[torch.Tensor]:
    """transformers' logits of the prompts as one right-padded batch with its attention mask
    (per-token logits cut to each prompt's length)."""
    longest = max(len(p) for p in prompts)
    ids = torch.tensor([p + [0] * (longest - len(p)) for p in prompts])
    mask = torch.tensor([[1] * len(p) + [0] * (longest - len(p)) for p in prompts])
    with torch.no_grad():
        logits = model(input_ids=ids, attention_mask=mask).logits
    if logits.dim() == 2:
        return list(logits)
    return [row[: len(p)] for row, p in zip(logits, prompts, strict=True)]


def hf_logits(model: Any, encoded: dict[str, Any]) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=torch.tensor([encoded["input_ids"]])).logits[0]


@contextmanager
def serve(path: Path) -> Iterator[TestClient]:
    settings = ServerSettings(model=str(path), served_model_name="m")
    with TestClient(create_app(settings)) as client:
        yield client


def post(client: TestClient, path: str, **body: Any) -> Any:
    response = client.post(path, json=body)
    assert response.status_code == 200, response.text
    return response.json()


@pytest.mark.parametrize("pooling", sorted(SEQUENCE_POOLINGS))
def test_sequence_classifier_equals_hf(tmp_path: Path, pooling: str) -> None:
    reference = build("EuroBertForSequenceClassification", num_labels=3, classifier_pooling=pooling)
    loaded = load_model(str(save(reference, tmp_path)), device=CPU)
    assert loaded.spec.head_kind is HeadKind.SEQUENCE_CLASSIFIER
    assert loaded.spec.num_labels == 3 and not loaded.spec.is_causal
    info = pooling_info_from(loaded)
    assert info.sequence_pooling_type is SEQUENCE_POOLINGS[pooling]
    assert PoolingTask.CLASSIFY in info.supported_tasks
    head = loaded.head
    assert head is not None
    prompts = make_prompts(LENGTHS, seed=4)
    wanted = padded_logits(reference, prompts)
    for states, want in zip(run_packed(loaded, prompts), wanted, strict=True):
        with torch.no_grad():
            got = head(REDUCE[info.sequence_pooling_type](states))
            # late is not the head on the mean state: GELU sits between the mean and the logits
            on_mean = head(states.mean(dim=0, keepdim=True)) if pooling == "late" else got
        assert_close(got, want, rel=REL)
        if len(states) > 1 and pooling == "late":
            assert (on_mean - want).abs().max() > 1e-3 * want.abs().max()


def test_an_unknown_classifier_pooling_is_refused(tmp_path: Path) -> None:
    reference = build("EuroBertForSequenceClassification", num_labels=2)
    save(reference, tmp_path)
    config = tmp_path / "config.json"
    config.write_text(config.read_text().replace('"late"', '"cls"'))
    with pytest.raises(ModelLoadError, match="classifier_pooling 'cls'"):
        load_model(str(tmp_path), device=CPU)


def test_token_classifier_equals_hf(tmp_path: Path) -> None:
    reference = build("EuroBertForTokenClassification", num_labels=4)
    loaded = load_model(str(save(reference, tmp_path)), device=CPU)
    assert loaded.spec.head_kind is HeadKind.TOKEN_CLASSIFIER and loaded.spec.num_labels == 4
    head = loaded.head
    assert head is not None
    prompts = make_prompts(LENGTHS, seed=5)
    wanted = padded_logits(reference, prompts)
    for states, want in zip(run_packed(loaded, prompts), wanted, strict=True):
        with torch.no_grad():
            assert_close(head(states), want, rel=REL)


# untied with biases in the MLP and lm_head; tied to the embeddings without biases
@pytest.mark.parametrize(
    "overrides",
    [{"mlp_bias": True}, {"tie_word_embeddings": True}],
    ids=["untied_bias", "tied"],
)
def test_masked_lm_head_equals_hf(tmp_path: Path, overrides: dict[str, Any]) -> None:
    reference = build("EuroBertForMaskedLM", **overrides)
    loaded = load_model(str(save(reference, tmp_path)), device=CPU)
    assert loaded.spec.head_kind is HeadKind.MASKED_LM and loaded.spec.num_labels is None
    assert PoolingTask.EMBED_SPARSE in pooling_info_from(loaded).supported_tasks
    head = loaded.head
    assert head is not None
    prompts = make_prompts(LENGTHS, seed=6)
    wanted = padded_logits(reference, prompts)
    for states, want in zip(run_packed(loaded, prompts), wanted, strict=True):
        with torch.no_grad():
            assert_close(head(states), want, rel=REL)


def test_masked_lm_saved_without_its_head_serves_dense_only(tmp_path: Path) -> None:
    # sentence-transformers saves the backbone alone: the MLM class, no lm_head, no prefix
    backbone = build("EuroBertModel")
    save(backbone, tmp_path)
    config = tmp_path / "config.json"
    config.write_text(config.read_text().replace('"EuroBertModel"', '"EuroBertForMaskedLM"'))
    loaded = load_model(str(tmp_path), device=CPU)
    assert loaded.spec.head_kind is HeadKind.MASKED_LM and loaded.head is None
    prompt = make_prompts((9,), seed=7)
    with torch.no_grad():
        want = backbone(input_ids=torch.tensor(prompt)).last_hidden_state[0]
    assert_close(run_packed(loaded, prompt)[0], want, rel=REL)


def test_served_classifier_equals_hf_softmax(tmp_path: Path) -> None:
    reference = build("EuroBertForSequenceClassification", num_labels=3, classifier_pooling="late")
    path = save(reference, tmp_path)
    tokenizer = AutoTokenizer.from_pretrained(str(path))
    with serve(path) as client:
        probs = post(client, "/v1/classify", model="m", input=TEXTS)
        raw = post(client, "/v1/classify", model="m", input=TEXTS, use_activation=False)
    for index, text in enumerate(TEXTS):
        logits = hf_logits(reference, tokenizer(text))
        assert_close(torch.tensor(probs["data"][index]["probs"]), logits.softmax(-1), rel=REL)
        assert_close(torch.tensor(raw["data"][index]["probs"]), logits, rel=REL)


@pytest.mark.parametrize("pooling", ["bos", "mean"])
def test_served_one_label_classifier_scores_pairs(tmp_path: Path, pooling: str) -> None:
    reference = build("EuroBertForSequenceClassification", num_labels=1, classifier_pooling=pooling)
    path = save(reference, tmp_path)
    tokenizer = AutoTokenizer.from_pretrained(str(path))
    with serve(path) as client:
        scored = post(client, "/score", model="m", text_1=QUERY, text_2=DOCUMENTS)
        reranked = post(client, "/rerank", model="m", query=QUERY, documents=DOCUMENTS)
    # the pair laid out by the tokenizer ([CLS] query [SEP] document [SEP]), sigmoid of its logit
    want = [torch.sigmoid(hf_logits(reference, tokenizer(QUERY, d)))[0] for d in DOCUMENTS]
    got = [item["score"] for item in scored["data"]]
    assert_close(torch.tensor(got), torch.stack(want), rel=REL)
    by_index = {item["index"]: item["relevance_score"] for item in reranked["results"]}
    assert_close(torch.tensor([by_index[i] for i in range(len(DOCUMENTS))]), torch.tensor(got))


def test_served_token_classifier_and_sparse_embeddings(tmp_path: Path) -> None:
    tokens = build("EuroBertForTokenClassification", num_labels=4)
    tokens_path = save(tokens, tmp_path / "tokens")
    tokenizer = AutoTokenizer.from_pretrained(str(tokens_path))
    with serve(tokens_path) as client:
        answer = post(client, "/v1/pooling", model="m", input=TEXTS, task="token_classify")
    for item, text in zip(answer["data"], TEXTS, strict=True):
        want = hf_logits(tokens, tokenizer(text)).softmax(-1)  # [T, 4]
        assert_close(torch.tensor(item["data"]), want, rel=REL)
    mlm = build("EuroBertForMaskedLM", mlp_bias=True)
    mlm_path = save(mlm, tmp_path / "mlm")
    with serve(mlm_path) as client:
        answer = post(client, "/v1/pooling", model="m", input=TEXTS, task="embed_sparse")
    for item, text in zip(answer["data"], TEXTS, strict=True):
        ids = tokenizer(text)["input_ids"]
        logits = hf_logits(mlm, {"input_ids": ids})
        kept = [i for i, token in enumerate(ids) if token not in SKIPPED]
        want = torch.log1p(torch.relu(logits[kept])).amax(dim=0)  # [vocab], SPLADE
        got = torch.zeros_like(want)
        got[item["data"]["indices"]] = torch.tensor(item["data"]["values"])
        assert_close(got, want, rel=REL)
