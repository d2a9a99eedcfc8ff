"""vLLM 0.33's `/pooling` route tests (tests/entrypoints/pooling/pooling/test_online.py), ported.

vLLM serves internlm/internlm2-1_8b-reward (a reward per token) with a dummy chat template; here
the tiny `Qwen2ForRewardModel` checkpoint (a reward per token too) with the same template in its
tokenizer config (this server reads a checkpoint's template: no `--chat-template` flag). Where
vLLM pins the model's token ids, the reference is the checkpoint's own tokenizer; the rewards
themselves are checked against transformers' backbone and the checkpoint's head.

Deliberate differences (docs/api.md, "POST /v1/pooling and /pooling"): a per-token reward is
`[num_tokens]` here (vLLM: `[num_tokens, 1]`); a refused field's message is one readable line
naming the field and the value sent, without pydantic's error type (vLLM: "literal_error").
"""

from __future__ import annotations

import base64
import json
import shutil
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, Literal

import httpx
import numpy as np
import pytest
import torch
from transformers import AutoTokenizer

from tests.http.serving import LiveServers, assert_close, hf_hidden
from tests.tiny_models import reference_remote_head

MODEL = "reward"
DUMMY_CHAT_TEMPLATE = (
    "{% for message in messages %}{{message['role'] + ': ' + message['content'] + '\\n'}}"
    "{% endfor %}"
)
INPUT_TEXT = "The chef prepared a delicious meal."
MESSAGES = [
    {"role": "user", "content": "The cat sat on the mat."},
    {"role": "assistant", "content": "A feline was resting on a rug."},
    {"role": "user", "content": "Stars twinkle brightly in the night sky."},
]
EMBED_DTYPES = ("float32", "float16", "bfloat16", "fp8_e4m3", "fp8_e5m2")
ENDIANNESS = ("native", "big", "little")
BYTE_ORDERS: dict[str, Literal["<", ">"]] = {"little": "<", "big": ">"}


@pytest.fixture(scope="module")
def model_dir(
    tiny_model_dir: Callable[[str], Path], tmp_path_factory: pytest.TempPathFactory
) -> Path:
    """The tiny per-token reward model with vLLM's dummy chat template."""
    directory = Path(
        shutil.copytree(tiny_model_dir("qwen2_rm"), tmp_path_factory.mktemp("reward") / "m")
    )
    config_path = directory / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    config["chat_template"] = DUMMY_CHAT_TEMPLATE
    config_path.write_text(json.dumps(config))
    return directory


@pytest.fixture(scope="module")
def client(live_servers: LiveServers, model_dir: Path) -> httpx.Client:
    # vLLM: --runner pooling --max-model-len 512 --chat-template DUMMY_CHAT_TEMPLATE
    return live_servers.serve(model_dir, MODEL, max_model_len=512)


@pytest.fixture(scope="module")
def tokenizer(model_dir: Path) -> Any:
    return AutoTokenizer.from_pretrained(str(model_dir))


@pytest.fixture(scope="module")
def input_tokens(tokenizer: Any) -> list[int]:
    return list(tokenizer(INPUT_TEXT)["input_ids"])


def _rewards(ids: list[int]) -> torch.Tensor:
    """transformers' reference: the checkpoint's head over the backbone, one reward per token."""
    return reference_remote_head("qwen2_rm")(hf_hidden("qwen2_rm", ids))[:, 0]


def _pool(client: Any, path: str = "/pooling", **body: Any) -> Any:
    response = client.post(path, json={"model": MODEL, **body})
    assert response.status_code == 200, response.text
    return response


def _check_embeddings_close(first: Sequence[Any], second: Sequence[Any], tol: float = 1e-3) -> None:
    """vLLM's check_embeddings_close: each pair's cosine similarity within tol of 1."""
    assert len(first) == len(second)
    for a, b in zip(first, second, strict=True):
        x, y = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
        assert x.shape == y.shape, (x.shape, y.shape)
        cosine = float(x @ y / (np.linalg.norm(x) * np.linalg.norm(y)))
        assert cosine >= 1 - tol, cosine


def _decode(raw: bytes, dtype: str, endianness: str) -> np.ndarray:
    """Bytes -> float32, read with torch (as vLLM's clients do), not the server's encoder."""
    torch_dtype = {
        "float32": torch.float32,
        "float16": torch.float16,
        "bfloat16": torch.bfloat16,
        "fp8_e4m3": torch.float8_e4m3fn,
        "fp8_e5m2": torch.float8_e5m2,
    }[dtype]
    width = torch.tensor([], dtype=torch_dtype).element_size()
    order = BYTE_ORDERS[sys.byteorder if endianness == "native" else endianness]
    words = np.frombuffer(raw, dtype=np.dtype(f"u{width}").newbyteorder(order)).astype(f"=u{width}")
    return torch.from_numpy(words.view(np.uint8).copy()).view(torch_dtype).float().numpy()


def _check_usage(document: dict[str, Any], tokens: int) -> None:
    assert document["usage"]["completion_tokens"] == 0
    assert document["usage"]["prompt_tokens"] == tokens
    assert document["usage"]["total_tokens"] == tokens


# Ports test_basic.
def test_basic(client: Any, input_tokens: list[int]) -> None:
    assert client.get("/v1/models").json()["data"][0]["id"] == MODEL
    response = client.post("/tokenize", json={"model": MODEL, "prompt": INPUT_TEXT})
    assert response.json()["tokens"] == input_tokens


# Ports test_completion_request: a string, then its token ids; the rewards also against
# transformers (vLLM checks shapes and usage only).
def test_completion_request(client: Any, input_tokens: list[int]) -> None:
    for given in (INPUT_TEXT, input_tokens):
        document = _pool(client, input=given, encoding_format="float").json()
        assert document["id"]
        assert len(document["data"]) == 1
        assert len(document["data"][0]["data"]) == len(input_tokens)
        _check_usage(document, len(input_tokens))
        assert_close(document["data"][0]["data"], _rewards(input_tokens))


# Ports test_completion_request_batched: ten strings, then ten token-id lists.
def test_completion_request_batched(client: Any, input_tokens: list[int]) -> None:
    n = 10
    for given in ([INPUT_TEXT] * n, [input_tokens] * n):
        document = _pool(client, input=given, encoding_format="float").json()
        assert document["id"]
        assert len(document["data"]) == n
        assert len(document["data"][0]["data"]) == len(input_tokens)
        _check_usage(document, len(input_tokens) * n)


# Ports test_conversation_pooling: `messages` equals its rendered prompt sent as `input` without
# special tokens, the answer alike but for id and created.
def test_conversation_pooling(client: Any, tokenizer: Any) -> None:
    chat = _pool(client, messages=MESSAGES, encoding_format="float").json()
    prompt = tokenizer.apply_chat_template(
        MESSAGES,
        chat_template=DUMMY_CHAT_TEMPLATE,
        add_generation_prompt=True,
        continue_final_message=False,
        tokenize=False,
    )
    body = {"input": prompt, "encoding_format": "float", "add_special_tokens": False}
    completion = _pool(client, **body).json()
    assert chat["id"] and completion["id"]
    assert chat["created"] <= completion["created"]
    ignored = ("id", "created")
    assert {k: v for k, v in chat.items() if k not in ignored} == {
        k: v for k, v in completion.items() if k not in ignored
    }


# Ports test_batch_base64_pooling: float, base64 (float32) and the default format agree.
# Difference kept: a per-token reward is [num_tokens] here, so vLLM's squeeze(-1) of its
# [num_tokens, 1] has nothing to remove (docs/api.md).
def test_batch_base64_pooling(client: Any) -> None:
    texts = [
        "Hello my name is",
        "The best thing about vLLM is that it supports many different models",
    ]
    floats = [d["data"] for d in _pool(client, input=texts, encoding_format="float").json()["data"]]
    assert all(np.asarray(f).ndim == 1 for f in floats)
    encoded = _pool(client, input=texts, encoding_format="base64").json()["data"]
    decoded = [np.frombuffer(base64.b64decode(d["data"]), dtype="float32") for d in encoded]
    _check_embeddings_close(floats, decoded)
    default = [d["data"] for d in _pool(client, input=texts).json()["data"]]
    _check_embeddings_close(floats, default)


def _floats(client: Any, texts: list[str]) -> Any:
    return _pool(client, input=texts, encoding_format="float").json()


# Ports test_base64_embed_dtype_and_endianness: every embed_dtype in every byte order.
def test_base64_embed_dtype_and_endianness(client: Any) -> None:
    texts = [INPUT_TEXT] * 3
    floats = [d["data"] for d in _floats(client, texts)["data"]]
    for dtype in EMBED_DTYPES:
        for endianness in ENDIANNESS:
            body = {"encoding_format": "base64", "embed_dtype": dtype, "endianness": endianness}
            data = _pool(client, input=texts, **body).json()["data"]
            decoded = [_decode(base64.b64decode(d["data"]), dtype, endianness) for d in data]
            _check_embeddings_close(floats, decoded, tol=1e-2)


# Ports test_bytes_embed_dtype_and_endianness: the body cut by the `metadata` header's items.
# Difference kept: each item's shape is [num_tokens] here, [num_tokens, 1] in vLLM.
def test_bytes_embed_dtype_and_endianness(client: Any) -> None:
    texts = [INPUT_TEXT] * 3
    document = _floats(client, texts)
    floats = [d["data"] for d in document["data"]]
    n_tokens = document["usage"]["prompt_tokens"] // len(texts)
    for dtype in EMBED_DTYPES:
        for endianness in ENDIANNESS:
            body = {"encoding_format": "bytes", "embed_dtype": dtype, "endianness": endianness}
            response = _pool(client, input=texts, **body)
            items = json.loads(response.headers["metadata"])["data"]
            decoded = []
            for item in items:
                assert item["shape"] == [n_tokens]
                raw = response.content[item["start"] : item["end"]]
                values = _decode(raw, item["embed_dtype"], item["endianness"])
                decoded.append(values.reshape(item["shape"]).reshape(-1))
            _check_embeddings_close(floats, decoded, tol=1e-2)


# Ports test_bytes_only_embed_dtype_and_endianness: no header, the body cut by the shape the
# client knows. Difference kept: that shape is (num_tokens,) here, (num_tokens, 1) in vLLM.
def test_bytes_only_embed_dtype_and_endianness(client: Any) -> None:
    texts = [INPUT_TEXT] * 3
    document = _floats(client, texts)
    floats = [d["data"] for d in document["data"]]
    n_tokens = document["usage"]["prompt_tokens"] // len(texts)
    for dtype in EMBED_DTYPES:
        for endianness in ENDIANNESS:
            body = {"encoding_format": "bytes_only", "embed_dtype": dtype, "endianness": endianness}
            response = _pool(client, input=texts, **body)
            assert "metadata" not in response.headers
            values = _decode(response.content, dtype, endianness)
            assert values.size == n_tokens * len(texts)
            _check_embeddings_close(floats, list(values.reshape(len(texts), n_tokens)), tol=1e-2)


# Ports test_params_not_supported: a bad value of each is a 400 naming the value sent.
# Difference kept: vLLM's message is pydantic's error list ("literal_error" in it); this
# server's is one line naming the field, the accepted values and the value sent (docs/api.md).
@pytest.mark.parametrize("param_name", ["encoding_format", "embed_dtype", "endianness"])
def test_params_not_supported(client: Any, param_name: str) -> None:
    body = {"model": MODEL, "input": INPUT_TEXT, "encoding_format": "base64"}
    response = client.post("/pooling", json={**body, param_name: f"bad_{param_name}"})
    assert response.status_code == 400
    error = response.json()["error"]
    assert "literal_error" not in error["message"]
    assert f"bad_{param_name}" in error["message"], error
    assert error["param"] == param_name


def _check_invocations(client: Any, body: dict[str, Any]) -> None:
    pooled = _pool(client, **body).json()
    invoked = _pool(client, "/invocations", **body).json()
    assert pooled.keys() == invoked.keys()
    for ours, theirs in zip(pooled["data"], invoked["data"], strict=True):
        assert ours.keys() == theirs.keys()
        _check_embeddings_close([ours["data"]], [theirs["data"]])


# Ports test_invocations: SageMaker's route answers a pooling body as /pooling does.
def test_invocations(client: Any) -> None:
    _check_invocations(client, {"input": INPUT_TEXT, "encoding_format": "float"})


# Ports test_invocations_conversation: the same with `messages`.
def test_invocations_conversation(client: Any) -> None:
    _check_invocations(client, {"messages": MESSAGES, "encoding_format": "float"})
