"""vLLM 0.33's classify and token_classify HTTP tests, ported.

The same requests and assertions as vLLM's tests/entrypoints/pooling/classify/test_online.py and
tests/entrypoints/pooling/token_classify/test_online.py, on tiny random checkpoints instead of
jason9693/Qwen2.5-1.5B-apeach: its token ids, label names and token counts are replaced by
what transformers gives on the same checkpoint (its tokenizer, its chat template, the softmax of
its logits). Where this server answers differently on purpose, the case says why and asserts this
server's answer (docs/api.md lists each difference).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
import torch
from transformers import AutoTokenizer

from tests.http.serving import LiveServers, assert_close, hf_logits, start_together
from tests.tiny_models import build_hf_model

MODEL = "llama_cls3"  # LlamaForSequenceClassification, 3 labels
LABELS = ["negative", "neutral", "positive"]
INPUT_TEXT = "This product was excellent and exceeded my expectations"
MESSAGES = [
    {"role": "user", "content": "The cat sat on the mat."},
    {"role": "assistant", "content": "A feline was resting on a rug."},
    {"role": "user", "content": "Stars twinkle brightly in the night sky."},
]
# The tiny checkpoints carry no chat template (their tokenizer is MiniLM's): the request's own,
# which reads add_generation_prompt, so each chat option changes the prompt.
TEMPLATE = (
    "{% for m in messages %}<{{ m['role'] }}> {{ m['content'] }} </{{ m['role'] }}> "
    "{% endfor %}{% if add_generation_prompt %}<assistant>{% endif %}"
)


@pytest.fixture(scope="module")
def server(live_servers: LiveServers, model_dir: Path) -> httpx.Client:
    # vLLM: --max-model-len 512 --dtype float32
    return live_servers.serve(model_dir, MODEL, max_model_len=512, trust_request_chat_template=True)


@pytest.fixture(scope="module")
def model_dir(tiny_model_dir: Callable[[str], Path]) -> Path:
    return tiny_model_dir(MODEL)


@pytest.fixture(scope="module", autouse=True)
def _servers(request: pytest.FixtureRequest) -> None:
    start_together(request, ("server", "token_classify"))


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir: Callable[[str], Path]) -> Any:
    return AutoTokenizer.from_pretrained(str(tiny_model_dir(MODEL)))


@pytest.fixture(scope="module")
def input_tokens(tokenizer: Any) -> list[int]:
    return list(tokenizer(INPUT_TEXT)["input_ids"])


def _probs(name: str, ids: list[int]) -> np.ndarray:
    """The reference: softmax of the transformers model's logits."""
    return torch.softmax(hf_logits(name, ids), dim=-1).numpy()


def _classify(server: Any, **body: Any) -> dict[str, Any]:
    response = server.post("/classify", json={"model": MODEL, **body})
    assert response.status_code == 200, response.text
    return dict(response.json())


def _check_one(output: dict[str, Any], want: np.ndarray) -> None:
    assert output["object"] == "list"
    assert output["model"] == MODEL
    assert len(output["data"]) == 1
    item = output["data"][0]
    assert item["label"] == LABELS[int(np.argmax(want))]
    assert_close(item["probs"], want)


# classify/test_online.py


def test_basic(server: Any, input_tokens: list[int]) -> None:
    """vLLM's test_basic: /v1/models names the model, /tokenize gives the tokenizer's ids."""
    assert server.get("/v1/models").json()["data"][0]["id"] == MODEL
    response = server.post("/tokenize", json={"model": MODEL, "prompt": INPUT_TEXT})
    assert response.json()["tokens"] == input_tokens


def test_completion_request(server: Any, input_tokens: list[int]) -> None:
    """vLLM's test_completion_request: a string and a token-id list, one answer each."""
    want = _probs(MODEL, input_tokens)
    _check_one(_classify(server, input=INPUT_TEXT), want)
    _check_one(_classify(server, input=input_tokens), want)


def test_completion_request_batched(server: Any, input_tokens: list[int]) -> None:
    """vLLM's test_completion_request_batched: ten strings, then ten token-id lists."""
    n = 10
    want = _probs(MODEL, input_tokens)
    for batch in ([INPUT_TEXT] * n, [input_tokens] * n):
        data = _classify(server, input=batch)["data"]
        assert len(data) == n
        for i, item in enumerate(data):
            assert item["index"] == i
            assert len(item["probs"]) == item["num_classes"] == len(LABELS)
            assert item["label"] in LABELS
            assert_close(item["probs"], want)


def test_empty_input_error(server: Any) -> None:
    """vLLM's test_empty_input_error: "" and [] are 400s with an error body."""
    empty_inputs: tuple[str | list[int], ...] = ("", [])
    for empty in empty_inputs:
        response = server.post("/classify", json={"model": MODEL, "input": empty})
        assert response.status_code == 400
        assert "error" in response.json()


def test_truncate_prompt_tokens(server: Any, tokenizer: Any) -> None:
    """vLLM's test_truncate_prompt_tokens: 5 tokens kept; above max_model_len (512) a 400."""
    long_text = "hello " * 600
    output = _classify(server, input=long_text, truncate_prompt_tokens=5)
    assert len(output["data"]) == 1
    assert output["data"][0]["index"] == 0
    assert output["usage"]["prompt_tokens"] == 5
    assert output["usage"]["total_tokens"] == 5
    # the reference: the tokenizer's own truncation to 5 tokens, its special tokens kept
    ids = tokenizer(long_text, truncation=True, max_length=5)["input_ids"]
    assert_close(output["data"][0]["probs"], _probs(MODEL, ids))

    body = {"model": MODEL, "input": "test", "truncate_prompt_tokens": 513}
    response = server.post("/classify", json=body)
    assert response.status_code == 400
    assert "truncate_prompt_tokens" in response.json()["error"]["message"]


def test_add_special_tokens(server: Any, tokenizer: Any) -> None:
    """vLLM's test_add_special_tokens: both values answer (here the prompt is checked too)."""
    for add in (False, True):
        output = _classify(server, input=INPUT_TEXT, add_special_tokens=add)
        ids = tokenizer(INPUT_TEXT, add_special_tokens=add)["input_ids"]
        assert output["usage"]["prompt_tokens"] == len(ids)
        assert_close(output["data"][0]["probs"], _probs(MODEL, ids))


def _chat_ids(tokenizer: Any, add_special_tokens: bool = False, **options: Any) -> list[int]:
    """vLLM's chat prompt: the template's text, tokenized without special tokens unless asked."""
    text = tokenizer.apply_chat_template(
        MESSAGES, chat_template=TEMPLATE, tokenize=False, **options
    )
    return list(tokenizer(text, add_special_tokens=add_special_tokens)["input_ids"])


@pytest.mark.parametrize(
    "options",
    [
        {},
        {"add_generation_prompt": True},
        {"continue_final_message": True},
        {"add_special_tokens": True},
    ],
)
def test_chat_request(server: Any, tokenizer: Any, options: dict[str, Any]) -> None:
    """vLLM's test_chat_request: each chat option; vLLM's token counts (51, 54, 49, 51) are
    its model's template's: here the count of the same conversation under this template."""
    output = _classify(server, messages=MESSAGES, chat_template=TEMPLATE, **options)
    ids = _chat_ids(tokenizer, **options)
    assert output["usage"]["prompt_tokens"] == len(ids)
    _check_one(output, _probs(MODEL, ids))


def test_chat_request_both_options(server: Any) -> None:
    """vLLM's test_chat_request, last step: continue_final_message with add_generation_prompt."""
    body = {
        "model": MODEL,
        "messages": MESSAGES,
        "chat_template": TEMPLATE,
        "continue_final_message": True,
        "add_generation_prompt": True,
    }
    response = server.post("/classify", json=body)
    assert response.status_code == 400
    message = "Cannot set both `continue_final_message` and `add_generation_prompt` to True."
    assert message in response.json()["error"]["message"]


@pytest.mark.parametrize(
    "body",
    [{"input": INPUT_TEXT}, {"messages": MESSAGES, "chat_template": TEMPLATE}],
    ids=["completion", "chat"],
)
def test_invocations(server: Any, body: dict[str, Any]) -> None:
    """vLLM's test_invocations_completion_request and test_invocations_chat_request:
    SageMaker's /invocations answers as /classify."""
    classified = _classify(server, **body)
    invoked = server.post("/invocations", json={"model": MODEL, **body})
    assert invoked.status_code == 200, invoked.text
    assert classified.keys() == invoked.json().keys()
    for one, other in zip(classified["data"], invoked.json()["data"], strict=True):
        assert one.keys() == other.keys()
        assert one["probs"] == pytest.approx(other["probs"], rel=0.01)


def test_use_activation(server: Any, input_tokens: list[int]) -> None:
    """vLLM's test_use_activation: the default is the softmax; without it, the logits."""

    def probs(use_activation: bool | None) -> torch.Tensor:
        output = _classify(server, input=INPUT_TEXT, use_activation=use_activation)
        return torch.tensor([item["probs"] for item in output["data"]])

    default, with_activation, without = probs(None), probs(True), probs(False)
    assert torch.allclose(default, with_activation, atol=1e-2)
    assert not torch.allclose(with_activation, without, atol=1e-2)
    assert torch.allclose(torch.softmax(without, dim=-1), with_activation, atol=1e-2)
    assert_close(without[0], hf_logits(MODEL, input_tokens))


@pytest.mark.parametrize(
    ("path", "body"),
    [
        ("/score", {"queries": "ping", "documents": "pong"}),
        ("/rerank", {"query": "ping", "documents": ["pong"]}),
    ],
    ids=["score", "rerank"],
)
def test_score_and_rerank_need_one_label(server: Any, path: str, body: dict[str, Any]) -> None:
    """vLLM's test_score and test_rerank: scoring serves only one-label classifiers, a 404.
    vLLM does not register the routes (FastAPI's {"detail": "Not Found"}); this server's 404
    has its own error body (docs/api.md, errors), so the status is what is compared."""
    response = server.post(path, json={"model": MODEL, **body})
    assert response.status_code == 404
    assert "error" in response.json()


def test_pooling_classify(server: Any, input_tokens: list[int]) -> None:
    """vLLM's test_pooling_classify: /pooling with task classify, one probability per label."""
    body = {"model": MODEL, "input": INPUT_TEXT, "encoding_format": "float", "task": "classify"}
    data = server.post("/pooling", json=body).json()["data"]
    assert len(data) == 1
    assert len(data[0]["data"]) == len(LABELS)
    assert_close(data[0]["data"], _probs(MODEL, input_tokens))


@pytest.mark.parametrize("task", ["embed", "token_embed", "token_classify", "plugin"])
def test_pooling_not_supported(server: Any, task: str) -> None:
    """vLLM's classify test_pooling_not_supported."""
    body = {"model": MODEL, "input": INPUT_TEXT, "encoding_format": "float", "task": task}
    response = server.post("/pooling", json=body)
    assert response.status_code == 400
    error = response.json()["error"]
    # vLLM: type "BadRequestError"; this server keeps OpenAI's type (docs/api.md, error body)
    assert error["type"] == "invalid_request_error"
    if task == "plugin":  # no task of any model here: refused by the body's schema
        assert error["param"] == "task", error
    else:
        # token_classify, vLLM: "Try switching the model's pooling_task via ..."; here too the
        # sequence classifier runs on every token only when --pooler-config names the task,
        # and the message names the tasks it serves (docs/api.md, classify)
        assert error["message"].startswith(f"Unsupported task: {task!r}"), error


# token_classify/test_online.py: vLLM serves the same sequence classifier started with
# pooling_task token_classify (its score head on every token)


@pytest.fixture(scope="module")
def token_classify(live_servers: LiveServers, model_dir: Path) -> httpx.Client:
    # vLLM: --max-model-len 512 --dtype float32 --pooler-config '{"pooling_task": "token_classify"}'
    config = '{"pooling_task": "token_classify"}'
    return live_servers.serve(model_dir, MODEL, max_model_len=512, pooler_config=config)


def _token_probs(ids: list[int]) -> torch.Tensor:
    """The reference: the checkpoint's score head on every token's final state, softmaxed."""
    model = build_hf_model(MODEL)
    with torch.inference_mode():
        hidden = model.model(input_ids=torch.tensor([ids])).last_hidden_state[0]
        return torch.softmax(model.score(hidden), dim=-1)  # [num_tokens, num_labels]


def test_pooling_token_classify(token_classify: Any, input_tokens: list[int]) -> None:
    """vLLM's test_pooling_token_classify: one row per token (vLLM's 8 are its tokenizer's count
    of the text: here transformers' tokenizer of the checkpoint), one probability per label."""
    body = {"model": MODEL, "input": INPUT_TEXT, "encoding_format": "float"}
    data = token_classify.post("/pooling", json={**body, "task": "token_classify"}).json()["data"]
    assert len(data) == 1
    assert len(data[0]["data"]) == len(input_tokens)
    assert len(data[0]["data"][0]) == len(LABELS)
    assert_close(data[0]["data"], _token_probs(input_tokens))


@pytest.mark.parametrize("task", ["embed", "token_embed", "plugin"])
def test_token_classify_pooling_not_supported(token_classify: Any, task: str) -> None:
    """vLLM's token_classify test_pooling_not_supported (its classify case: below)."""
    body = {"model": MODEL, "input": INPUT_TEXT, "encoding_format": "float", "task": task}
    response = token_classify.post("/pooling", json=body)
    assert response.status_code == 400
    error = response.json()["error"]
    # vLLM: type "BadRequestError"; this server keeps OpenAI's type (docs/api.md, error body)
    assert error["type"] == "invalid_request_error"
    if task == "plugin":
        assert error["param"] == "task", error
    else:
        assert error["message"].startswith(f"Unsupported task: {task!r}"), error


def test_token_classify_server_still_classifies(
    token_classify: Any, input_tokens: list[int]
) -> None:
    """vLLM's classify case of the same test answers "Try switching the model's pooling_task";
    here a model serves its own head's tasks and --pooler-config's task is its default
    (docs/api.md, classify), so classify answers as on the classify server."""
    body = {"model": MODEL, "input": INPUT_TEXT, "encoding_format": "float", "task": "classify"}
    response = token_classify.post("/pooling", json=body)
    assert response.status_code == 200, response.text
    assert_close(response.json()["data"][0]["data"], _probs(MODEL, input_tokens))
