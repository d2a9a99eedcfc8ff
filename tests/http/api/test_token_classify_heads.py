"""token_classify through a sequence classifier (vLLM's `--pooler-config '{"pooling_task":
"token_classify"}'` on a *ForSequenceClassification): the head on every token's final state.

The reference is transformers' own modules on its own hidden states: a decoder's `score`, BERT's,
GTE's and ModernBERT's `classifier` without the pooler layer their classify task pools through
(vLLM's BertForSequenceClassification, GteNewForSequenceClassification and
ModernBertForSequenceClassification hand the classifier alone to token_classify), RoBERTa's and
XLM-R's whole classification head (vLLM hands RobertaClassificationHead to token_classify).
Families vLLM does not serve as sequence classifiers are refused at start.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import AutoTokenizer

from tests.http.serving import assert_close, started_client
from tests.tiny_encoders import build_hf_encoder, encoder_dirs
from tests.tiny_models import build_hf_model

TEXTS = ["The cat sat on the mat.", "Stars twinkle brightly in the night sky above the hills"]
CONFIG = '{"pooling_task": "token_classify"}'
Head = Callable[[Any, torch.Tensor], torch.Tensor]


def _classifier(model: Any, hidden: torch.Tensor) -> torch.Tensor:
    return model.classifier(hidden)  # [T, labels]: the pooler layer left out


def _roberta_head(model: Any, hidden: torch.Tensor) -> torch.Tensor:
    # RobertaClassificationHead.forward reads the first token only: its layers, on every token
    head = model.classifier
    return head.out_proj(torch.tanh(head.dense(hidden)))  # [T, labels]


def _score(model: Any, hidden: torch.Tensor) -> torch.Tensor:
    return model.score(hidden)  # [T, labels]


# tiny checkpoint -> (its transformers model, what vLLM runs on each token's state)
ENCODERS: dict[str, Head] = {
    "bert_cls": _classifier,
    "gte_cls": _classifier,
    "modernbert_cls": _classifier,
    "modernbert_mean": _classifier,  # mean-pooling classify, the same per-token head
    "roberta_cls": _roberta_head,
    "xlmroberta_cls": _roberta_head,
}
DECODERS: dict[str, Head] = {"llama_cls3": _score, "llama_cls1": _score}


@pytest.fixture(scope="module")
def encoder_dir(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], Path]:
    return encoder_dirs(tmp_path_factory, functools.cache(build_hf_encoder))


def _directory(
    name: str, encoder_dir: Callable[[str], Path], tiny_model_dir: Callable[[str], Path]
) -> Path:
    return encoder_dir(name) if name in ENCODERS else tiny_model_dir(name)


def _reference(name: str, ids: list[int], use_activation: bool) -> torch.Tensor:
    """The head on every token's final hidden state, then vLLM's token activation."""
    model = build_hf_encoder(name) if name in ENCODERS else build_hf_model(name)
    head = {**ENCODERS, **DECODERS}[name]
    with torch.inference_mode():
        hidden = model.base_model(input_ids=torch.tensor([ids])).last_hidden_state[0]
        logits = head(model, hidden).float()  # [T, labels]
    if not use_activation:
        return logits
    # vLLM's PoolerClassify without static labels: sigmoid for one label, else softmax
    return torch.sigmoid(logits) if logits.shape[-1] == 1 else torch.softmax(logits, dim=-1)


@pytest.fixture(scope="module")
def served(
    encoder_dir: Callable[[str], Path], tiny_model_dir: Callable[[str], Path]
) -> Iterator[Callable[[str], Any]]:
    """name -> its app, started with pooling_task token_classify (once per name)."""
    stack: dict[str, Any] = {}
    managers = []

    def get(name: str) -> Any:
        if name not in stack:
            path = _directory(name, encoder_dir, tiny_model_dir)
            manager = started_client(lambda _: path, name, pooler_config=CONFIG)
            managers.append(manager)
            stack[name] = manager.__enter__()
        return stack[name]

    yield get
    for manager in reversed(managers):
        manager.__exit__(None, None, None)


@pytest.mark.parametrize("use_activation", [True, False])
@pytest.mark.parametrize("name", sorted({**ENCODERS, **DECODERS}))
def test_every_token_through_the_sequence_head_equals_transformers(
    name: str,
    use_activation: bool,
    served: Callable[[str], Any],
    encoder_dir: Callable[[str], Path],
    tiny_model_dir: Callable[[str], Path],
) -> None:
    client = served(name)
    body = {"input": TEXTS, "task": "token_classify", "use_activation": use_activation}
    response = client.post("/pooling", json=body)
    assert response.status_code == 200, response.text
    data = response.json()["data"]
    tokenizer = AutoTokenizer.from_pretrained(str(_directory(name, encoder_dir, tiny_model_dir)))
    assert len(data) == len(TEXTS)
    for item, text in zip(data, TEXTS, strict=True):
        ids = list(tokenizer(text)["input_ids"])
        assert_close(item["data"], _reference(name, ids, use_activation))


def test_the_task_is_the_default_and_listed(served: Callable[[str], Any]) -> None:
    """Started for token_classify, /pooling without a task runs it and the card lists it."""
    client = served("bert_cls")
    data = client.post("/pooling", json={"input": TEXTS[0]}).json()["data"]
    assert len(data[0]["data"][0]) == 3  # [num_tokens, num_labels]
    assert "token_classify" in client.get("/info").json()["tasks"]


@pytest.mark.parametrize(
    "name", ["distilbert_cls", "mpnet_cls", "nomicbert_cls", "debertav3_reward"]
)
def test_a_family_vllm_does_not_serve_is_refused_at_start(
    name: str, encoder_dir: Callable[[str], Path]
) -> None:
    path = encoder_dir(name)
    refused = pytest.raises(Exception, match=r"token_classify through \w+ForSequenceClassification")
    with refused, started_client(lambda _: path, name, pooler_config=CONFIG):
        pass
