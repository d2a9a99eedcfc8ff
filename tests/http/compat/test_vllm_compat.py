"""vLLM's request fields on /v1/embeddings, /v1/pooling and /v1/classify, each with its effect.

Field names come from vLLM's protocol (EmbeddingCompletionRequest, EmbeddingChatRequest,
PoolingCompletionRequest, PoolingChatRequest, ClassificationRequest); references are
transformers' own tokenizer, chat template and model.
"""

from __future__ import annotations

import base64
import json
import logging
import shutil
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from starlette.testclient import TestClient
from transformers import AutoTokenizer

from poolserve.config.settings import ServerSettings
from poolserve.http.api.schemas import EmbeddingRequest, PoolingRequestBody
from poolserve.http.app import create_app
from poolserve.http.bodies import IGNORED_FIELDS
from tests.http.serving import assert_close, hf_hidden

TEXT = "hello there general pooling"
MESSAGES = [
    {"role": "system", "content": "be brief"},
    {
        "role": "user",
        "content": [{"type": "text", "text": "what is"}, {"type": "text", "text": "pooling"}],
    },
]
# A template that reads every chat option, so each one changes the prompt.
TEMPLATE = (
    "{% for m in messages %}{{ m['role'] }} : {{ m['content'] }} ; {% endfor %}"
    "{% if add_generation_prompt %}assistant :{% endif %}"
    "{% if topic is defined %} topic {{ topic }}{% endif %}"
)
# Every field of vLLM's embedding and pooling requests (completion and chat forms), one
# accepted value each; `input` / `messages` are given by the test itself.
VLLM_FIELDS: dict[str, object] = {
    "model": "chat",
    "user": "someone",
    "encoding_format": "float",
    "dimensions": 16,
    "truncate_prompt_tokens": 8,
    "truncation_side": "left",
    "request_id": "req-1",
    "priority": 1,
    "add_special_tokens": True,
    "normalize": True,
    "use_activation": True,
    "embed_dtype": "float16",
    "endianness": "big",
    "padding": "do_not_pad",
    "cache_salt": "salt",
    "mm_processor_kwargs": {},
    "media_io_kwargs": {},
    "task": "embed",
}
CHAT_FIELDS: dict[str, object] = {
    "add_generation_prompt": True,
    "continue_final_message": False,
    "chat_template": TEMPLATE,
    "chat_template_kwargs": {"topic": "x"},
}
POOLING_ONLY = {"task"}


@pytest.fixture(scope="module")
def chat_dir(
    tiny_model_dir: Callable[[str], Path], tmp_path_factory: pytest.TempPathFactory
) -> Path:
    """The tiny llama with a chat template and Matryoshka dimensions declared."""
    directory = Path(
        shutil.copytree(tiny_model_dir("llama"), tmp_path_factory.mktemp("chat") / "m")
    )
    config_path = directory / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    config["chat_template"] = TEMPLATE
    config_path.write_text(json.dumps(config))
    model_config = json.loads((directory / "config.json").read_text())
    model_config["is_matryoshka"] = True
    (directory / "config.json").write_text(json.dumps(model_config))
    return directory


@pytest.fixture(scope="module")
def client(chat_dir: Path) -> Iterator[TestClient]:
    settings = ServerSettings(
        model=str(chat_dir),
        served_model_name="chat",
        max_model_len=64,
        trust_request_chat_template=True,
    )
    with TestClient(create_app(settings)) as c:
        yield c


@pytest.fixture(scope="module")
def tokenizer(chat_dir: Path) -> Any:
    return AutoTokenizer.from_pretrained(str(chat_dir))


def _post(client: TestClient, path: str, **body: Any) -> Any:
    response = client.post(path, json=body)
    assert response.status_code == 200, response.text
    return response


def _vec(client: TestClient, path: str = "/v1/embeddings", **body: Any) -> np.ndarray:
    key = "embedding" if path == "/v1/embeddings" else "data"
    return np.asarray(_post(client, path, **body).json()["data"][0][key], dtype=np.float32)


def _last(ids: list[int], normalize: bool = True, dimensions: int | None = None) -> torch.Tensor:
    """The reference: the HF model's last hidden state (the decoder's pooling), cut, normalized."""
    hidden = hf_hidden("llama", ids)[-1]
    hidden = hidden[:dimensions] if dimensions else hidden
    return torch.nn.functional.normalize(hidden, dim=-1) if normalize else hidden


def _chat_ids(tokenizer: Any, messages: list[dict[str, Any]], **options: Any) -> list[int]:
    """vLLM's chat prompt: the template's text, tokenized without specials unless asked."""
    add_special_tokens = options.pop("add_special_tokens", False)
    plain = [
        {**m, "content": "\n".join(p["text"] for p in m["content"])}
        if isinstance(m["content"], list)
        else m
        for m in messages
    ]
    text = tokenizer.apply_chat_template(plain, tokenize=False, **options)
    return list(tokenizer(text, add_special_tokens=add_special_tokens)["input_ids"])


def test_every_vllm_field_is_defined_here_or_listed_as_ignored() -> None:
    for name in [*VLLM_FIELDS, *CHAT_FIELDS]:
        assert name in PoolingRequestBody.model_fields, name
        if name not in POOLING_ONLY:
            assert name in EmbeddingRequest.model_fields, name
    documented = (Path(__file__).parents[3] / "docs" / "api.md").read_text()
    for name in [*VLLM_FIELDS, *CHAT_FIELDS, *IGNORED_FIELDS]:
        assert f"`{name}`" in documented, name


@pytest.mark.parametrize("path", ["/v1/embeddings", "/v1/pooling"])
def test_every_field_at_once_is_answered(client: TestClient, path: str) -> None:
    fields = {
        k: v for k, v in VLLM_FIELDS.items() if path == "/v1/pooling" or k not in POOLING_ONLY
    }
    _post(client, path, input=TEXT, **fields)
    _post(client, path, messages=MESSAGES, **fields, **CHAT_FIELDS)


def test_unknown_fields_are_accepted_with_a_warning(
    client: TestClient, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.WARNING, logger="poolserve.http.bodies"):
        got = _vec(client, input=TEXT, not_a_field=1, another={"x": 2})
    assert_close(got, _vec(client, input=TEXT))
    warned = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert any("not_a_field" in m and "another" in m for m in warned), warned
    tokens = _post(client, "/tokenize", prompt=TEXT, not_a_field=1).json()["tokens"]
    assert tokens == _post(client, "/tokenize", prompt=TEXT).json()["tokens"]
    streamed = client.post(
        "/v1/pooling", json={"input": TEXT, "stream": True, "request_id": "s-1", "x": 1}
    )
    assert streamed.status_code == 200 and streamed.headers["x-request-id"] == "s-1"


def test_ignored_vllm_fields_are_logged_and_change_nothing(
    client: TestClient, caplog: pytest.LogCaptureFixture
) -> None:
    ignored = {k: VLLM_FIELDS[k] for k in IGNORED_FIELDS}
    with caplog.at_level(logging.INFO, logger="poolserve.http.bodies"):
        got = _vec(client, input=TEXT, **ignored)
    assert_close(got, _vec(client, input=TEXT))
    logged = " ".join(r.getMessage() for r in caplog.records)
    assert all(name in logged for name in IGNORED_FIELDS), logged


@pytest.mark.parametrize("path", ["/v1/embeddings", "/v1/pooling"])
def test_use_activation_and_normalize_both_switch_normalization(
    client: TestClient, tokenizer: Any, path: str
) -> None:
    ids = list(tokenizer(TEXT)["input_ids"])
    for field in ("normalize", "use_activation"):
        assert_close(_vec(client, path, input=TEXT, **{field: False}), _last(ids, normalize=False))
        assert_close(_vec(client, path, input=TEXT, **{field: True}), _last(ids))
    refused = client.post(path, json={"input": TEXT, "normalize": True, "use_activation": False})
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "use_activation"


def test_use_activation_on_token_embed(client: TestClient, tokenizer: Any) -> None:
    ids = list(tokenizer(TEXT)["input_ids"])
    body = {"input": TEXT, "task": "token_embed", "use_activation": False}
    assert_close(
        _post(client, "/v1/pooling", **body).json()["data"][0]["data"], hf_hidden("llama", ids)
    )


def _decode(raw: bytes, dtype: str, order: str) -> np.ndarray:
    """Bytes -> float32, read independently of the server's encoder."""
    if dtype in ("float32", "float16"):
        return np.frombuffer(raw, dtype=np.dtype(dtype).newbyteorder(order)).astype(np.float32)
    if dtype == "bfloat16":  # the top half of a float32
        halves = np.frombuffer(raw, dtype=np.dtype("u2").newbyteorder(order)).astype(np.uint32)
        return (halves << 16).view(np.float32)
    fp8 = {"fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}[dtype]
    return torch.frombuffer(bytearray(raw), dtype=torch.uint8).view(fp8).float().numpy()


# dtype -> (relative rounding error of its mantissa, its smallest subnormal step)
PRECISION = {
    "float32": (1e-6, 0.0),
    "float16": (2**-11, 2**-24),
    "bfloat16": (2**-8, 0.0),
    "fp8_e4m3": (2**-4, 2**-9),
    "fp8_e5m2": (2**-3, 2**-16),
}


@pytest.mark.parametrize("path", ["/v1/embeddings", "/v1/pooling"])
@pytest.mark.parametrize("dtype", list(PRECISION))
def test_embed_dtype_and_endianness_in_base64(client: TestClient, path: str, dtype: str) -> None:
    want = _vec(client, path, input=TEXT)
    key = "embedding" if path == "/v1/embeddings" else "data"
    raw = {}
    for endianness in ("little", "big", "native"):
        body = {
            "input": TEXT,
            "encoding_format": "base64",
            "embed_dtype": dtype,
            "endianness": endianness,
        }
        raw[endianness] = base64.b64decode(_post(client, path, **body).json()["data"][0][key])
    got = _decode(raw["little"], dtype, "<")
    relative, step = PRECISION[dtype]
    assert np.all(np.abs(got - want) <= relative * np.abs(want) + step + 1e-9)
    width = {"float32": 4, "float16": 2, "bfloat16": 2}.get(dtype, 1)
    swapped = np.frombuffer(raw["little"], dtype=f"u{width}").byteswap().tobytes()
    assert raw["big"] == swapped
    assert raw["native"] == raw[sys.byteorder]


@pytest.mark.parametrize("path", ["/v1/embeddings", "/v1/pooling"])
def test_bytes_formats(client: TestClient, path: str) -> None:
    texts = [TEXT, "another one"]
    key = "embedding" if path == "/v1/embeddings" else "data"
    body: dict[str, Any] = {"input": texts, "encoding_format": "base64", "embed_dtype": "float16"}
    pieces = [base64.b64decode(d[key]) for d in _post(client, path, **body).json()["data"]]
    response = _post(client, path, **{**body, "encoding_format": "bytes", "endianness": "little"})
    assert response.headers["content-type"] == "application/octet-stream"
    assert response.content == b"".join(pieces)
    meta = json.loads(response.headers["metadata"])
    assert meta["usage"]["prompt_tokens"] > 0 and meta["model"] == "chat"
    for item, piece in zip(meta["data"], pieces, strict=True):
        assert response.content[item["start"] : item["end"]] == piece
        assert item["embed_dtype"] == "float16" and item["shape"] == [64]
    only = _post(client, path, **{**body, "encoding_format": "bytes_only"})
    assert only.content == response.content and "metadata" not in only.headers


def test_add_special_tokens(client: TestClient, tokenizer: Any) -> None:
    bare = list(tokenizer(TEXT, add_special_tokens=False)["input_ids"])
    full = list(tokenizer(TEXT)["input_ids"])
    assert bare != full
    for path in ("/v1/embeddings", "/v1/pooling"):
        assert_close(_vec(client, path, input=TEXT, add_special_tokens=False), _last(bare))
        assert_close(_vec(client, path, input=TEXT, add_special_tokens=True), _last(full))
    kept = _vec(client, input=TEXT, add_special_tokens=False, truncate_prompt_tokens=2)
    assert_close(kept, _last(bare[:2]))


@pytest.mark.parametrize("path", ["/v1/embeddings", "/v1/pooling"])
def test_messages_equal_the_chat_template_s_prompt(
    client: TestClient, tokenizer: Any, path: str
) -> None:
    cases: list[dict[str, Any]] = [
        {},
        {"add_generation_prompt": True},
        {"continue_final_message": True},
        {"add_special_tokens": True},
        {"chat_template_kwargs": {"topic": "retrieval"}},
        {"chat_template": "{{ messages[-1]['content'] }} !"},
    ]
    for options in cases:
        reference = dict(options)
        reference.update(reference.pop("chat_template_kwargs", {}))
        ids = _chat_ids(tokenizer, MESSAGES, **reference)
        assert_close(_vec(client, path, messages=MESSAGES, **options), _last(ids))
    usage = _post(client, path, messages=MESSAGES).json()["usage"]
    assert usage["prompt_tokens"] == len(_chat_ids(tokenizer, MESSAGES))


def test_chat_refusals(client: TestClient, make_client: Callable[..., Any]) -> None:
    both = {"messages": MESSAGES, "add_generation_prompt": True, "continue_final_message": True}
    assert client.post("/v1/embeddings", json=both).status_code == 400
    assert (
        client.post("/v1/embeddings", json={"input": TEXT, "messages": MESSAGES}).status_code == 400
    )
    assert client.post("/v1/embeddings", json={"messages": []}).status_code == 400
    image = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]
    assert client.post("/v1/embeddings", json={"messages": image}).status_code == 400
    broken = {"messages": MESSAGES, "chat_template": "{{ raise_exception('no system role') }}"}
    refused = client.post("/v1/embeddings", json=broken)
    assert refused.status_code == 400 and "no system role" in refused.json()["error"]["message"]
    with make_client("llama", max_model_len=64) as plain:  # no chat template, untrusted
        refused = plain.post("/v1/embeddings", json={"messages": MESSAGES})
        assert (
            refused.status_code == 400 and "no chat template" in refused.json()["error"]["message"]
        )
        own = plain.post("/v1/pooling", json={"messages": MESSAGES, "chat_template": TEMPLATE})
        assert own.status_code == 400 and own.json()["error"]["param"] == "chat_template"
        hidden = {"messages": MESSAGES, "chat_template_kwargs": {"chat_template": TEMPLATE}}
        assert plain.post("/v1/pooling", json=hidden).status_code == 400


def test_messages_are_bounded_before_rendering(chat_dir: Path) -> None:
    settings = ServerSettings(model=str(chat_dir), max_model_len=64, max_input_chars=100)
    with TestClient(create_app(settings)) as small:
        long = [{"role": "user", "content": "x " * 60}]
        refused = small.post("/v1/embeddings", json={"messages": long})
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "messages"


@pytest.mark.parametrize(
    "path,prefix", [("/v1/embeddings", "embd"), ("/v1/pooling", "pool"), ("/v1/classify", None)]
)
def test_request_id_in_the_id_and_header(client: TestClient, path: str, prefix: str | None) -> None:
    if prefix is None:  # the chat model has no classifier: the refusal still carries the header
        response = client.post(path, json={"input": TEXT, "request_id": "abc-1"})
        assert response.status_code == 400
        return
    response = _post(client, path, input=TEXT, request_id="abc-1")
    assert response.json()["id"] == f"{prefix}-abc-1"
    assert response.headers["x-request-id"] == "abc-1"
    header_wins = client.post(
        path, json={"input": TEXT, "request_id": "b"}, headers={"x-request-id": "h"}
    )
    assert header_wins.json()["id"] == f"{prefix}-h" and header_wins.headers["x-request-id"] == "h"
    plain = _post(client, path, input=TEXT)
    assert plain.json()["id"] == f"{prefix}-{plain.headers['x-request-id']}"
    bad = client.post(path, json={"input": TEXT, "request_id": "a b\r\nx: y"})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "request_id"


def test_classify_request_id_and_legacy_activation_names(
    make_client: Callable[..., Any], tiny_model_dir: Callable[[str], Path]
) -> None:
    with make_client("llama_cls3", max_model_len=64) as cls:
        response = _post(cls, "/v1/classify", input=TEXT, request_id="c-9")
        assert response.json()["id"] == "classify-c-9" and response.headers["x-request-id"] == "c-9"
        raw = _post(cls, "/v1/classify", input=TEXT, use_activation=False).json()["data"][0][
            "probs"
        ]
        for name in ("softmax", "activation"):
            got = _post(cls, "/v1/classify", input=TEXT, **{name: False}).json()["data"][0]["probs"]
            assert_close(got, np.asarray(raw, dtype=np.float32))
        probs = response.json()["data"][0]["probs"]
        assert_close(probs, torch.softmax(torch.tensor(raw), -1))
        ids = _post(cls, "/tokenize", prompt=TEXT).json()["tokens"]
        by_ids = _post(cls, "/v1/classify", input=ids).json()["data"][0]["probs"]
        assert_close(by_ids, np.asarray(probs, dtype=np.float32))
        chat = cls.post("/v1/classify", json={"messages": MESSAGES})
        assert chat.status_code == 400 and "no chat template" in chat.json()["error"]["message"]


def test_token_ids_dimensions_and_truncation(client: TestClient, tokenizer: Any) -> None:
    ids = list(tokenizer(TEXT)["input_ids"])
    for path in ("/v1/embeddings", "/v1/pooling"):
        assert_close(_vec(client, path, input=ids), _last(ids))
        assert_close(_vec(client, path, input=ids, dimensions=16), _last(ids, dimensions=16))
        assert_close(_vec(client, path, input=ids, truncate_prompt_tokens=3), _last(ids[:3]))
        left = _vec(client, path, input=ids, truncate_prompt_tokens=3, truncation_side="left")
        assert_close(left, _last(ids[-3:]))
        assert_close(_vec(client, path, input=ids, truncate_prompt_tokens=-1), _last(ids))


def test_priority_reaches_the_engine(client: TestClient, monkeypatch: pytest.MonkeyPatch) -> None:
    engine = client.app.state.poolserve.engine  # type: ignore[attr-defined]
    seen: list[int] = []
    original = engine.submit_many

    async def spy(
        prompts: Any, params: Any, priority: int, token_type_ids: Any = None, pixels: Any = None
    ) -> Any:
        seen.append(priority)
        return await original(prompts, params, priority, token_type_ids, pixels)

    monkeypatch.setattr(engine, "submit_many", spy)
    _post(client, "/v1/embeddings", input=TEXT, priority=-5)
    _post(client, "/v1/pooling", messages=MESSAGES, priority=3)
    assert seen == [-5, 3]
