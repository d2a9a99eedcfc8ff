"""vLLM 0.33's embedding HTTP tests, ported.

The same requests and assertions as vLLM's tests/entrypoints/pooling/embed/test_online.py
(read at vllm-project/vllm 00bd149), embed/test_online_dimensions.py and
embed/test_online_long_text.py (both at 2743730), embed/test_usage_policy.py (0780742) and
basic/test_truncation.py (1711f0d). vLLM serves intfloat/multilingual-e5-small (a 384-wide
sentence-transformers model with mean pooling) and all-MiniLM-L12-v2; here the bundled
all-MiniLM-L6-v2, also 384 wide with mean pooling, and its token ids and counts come from its own
tokenizer instead of vLLM's constants. Embeddings are checked against sentence-transformers (or
transformers' backbone, mean-pooled as its Pooling module does, where the prompt is token ids).
The Matryoshka cases declare `matryoshka_dimensions` by `--hf-overrides`, as vLLM's test does.

Where this server answers differently on purpose, the case asserts this server's answer and
says why (docs/api.md lists each difference).
"""

from __future__ import annotations

import base64
import json
import random
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import openai
import pytest
import torch
import torch.nn.functional as F
from sentence_transformers import SentenceTransformer
from transformers import AutoModel, AutoTokenizer

from tests.http.api.vllm_checks import (
    DUMMY_CHAT_TEMPLATE,
    EMBED_DTYPES,
    ENDIANNESS,
    check_embeddings_close,
    decode,
    with_chat_template,
)
from tests.http.serving import LiveServers, assert_close, start_together

MODEL = "minilm"
DIM = 384
INPUT_TEXT = "The best thing about vLLM is that it supports many different models"
MESSAGES = [
    {"role": "user", "content": "The cat sat on the mat."},
    {"role": "assistant", "content": "A feline was resting on a rug."},
    {"role": "user", "content": "Stars twinkle brightly in the night sky."},
]
TOO_BIG = "truncate_prompt_tokens value is greater than max_model_len. "
SMALLER = "Please request a smaller truncation size."


@pytest.fixture(scope="module")
def model_dir(minilm_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """MiniLM with vLLM's dummy chat template in its tokenizer config."""
    return with_chat_template(
        minilm_dir, tmp_path_factory.mktemp("minilm") / "m", DUMMY_CHAT_TEMPLATE
    )


@pytest.fixture(scope="module")
def server(live_servers: LiveServers, model_dir: Path) -> httpx.Client:
    # vLLM: --runner pooling --dtype bfloat16 --max-model-len 512
    #   --chat-template DUMMY_CHAT_TEMPLATE
    return live_servers.serve(model_dir, MODEL, max_model_len=512)


@pytest.fixture(scope="module")
def client(server: httpx.Client) -> openai.OpenAI:
    """The official client of the same server (vLLM's tests use it too)."""
    return _openai(server)


def _openai(server: httpx.Client) -> openai.OpenAI:
    # through the server's client, whose first request waits until the server is ready
    return openai.OpenAI(
        base_url=f"{server.base_url}/v1", api_key="none", http_client=server, max_retries=0
    )


@pytest.fixture(scope="module", autouse=True)
def _servers(request: pytest.FixtureRequest) -> None:
    start_together(request, ("server", "short_server", "matryoshka", "chunked"))


@pytest.fixture(scope="module")
def st(model_dir: Path) -> SentenceTransformer:
    return SentenceTransformer(str(model_dir), device="cpu")


@pytest.fixture(scope="module")
def tokenizer(model_dir: Path) -> Any:
    return AutoTokenizer.from_pretrained(str(model_dir))


@pytest.fixture(scope="module")
def backbone(model_dir: Path) -> Any:
    return AutoModel.from_pretrained(str(model_dir)).eval()


@pytest.fixture(scope="module")
def input_tokens(tokenizer: Any) -> list[int]:
    return list(tokenizer(INPUT_TEXT)["input_ids"])


def _mean(backbone: Any, ids: list[int]) -> torch.Tensor:
    """transformers' reference of MiniLM's Pooling module: the mean of the token states."""
    with torch.inference_mode():
        hidden = backbone(input_ids=torch.tensor([ids])).last_hidden_state[0]  # [tokens, 384]
    return hidden.mean(dim=0)


def _embedded(backbone: Any, ids: list[int]) -> torch.Tensor:
    return F.normalize(_mean(backbone, ids), dim=-1)


def _post(server: Any, path: str = "/v1/embeddings", /, **body: Any) -> Any:
    response = server.post(path, json={"model": MODEL, **body})
    assert response.status_code == 200, response.text
    return response


def _check_usage(usage: Any, tokens: int) -> None:
    assert usage.completion_tokens == 0  # a field of vLLM's UsageInfo, kept by the client
    assert usage.prompt_tokens == usage.total_tokens == tokens


# embed/test_online.py


def test_basic(server: Any, client: openai.OpenAI, input_tokens: list[int]) -> None:
    """vLLM's test_basic: /v1/models names the model; /tokenize gives the tokenizer's ids."""
    assert server.get("/v1/models").json()["data"][0]["id"] == MODEL
    assert client.models.list().data[0].id == MODEL
    response = server.post("/tokenize", json={"model": MODEL, "prompt": INPUT_TEXT})
    assert response.json()["tokens"] == input_tokens


def test_completion_request(
    client: openai.OpenAI, st: SentenceTransformer, input_tokens: list[int]
) -> None:
    """vLLM's test_completion_request: a string, then its token ids, equal to sentence-
    transformers."""
    for given in (INPUT_TEXT, input_tokens):
        answer = client.embeddings.create(model=MODEL, input=given, encoding_format="float")
        assert answer.id is not None  # type: ignore[attr-defined]
        assert len(answer.data) == 1
        assert len(answer.data[0].embedding) == DIM
        _check_usage(answer.usage, len(input_tokens))
        assert_close([d.embedding for d in answer.data], st.encode([INPUT_TEXT]))


def test_completion_request_batched(
    client: openai.OpenAI, st: SentenceTransformer, input_tokens: list[int]
) -> None:
    """vLLM's test_completion_request_batched: ten strings, then ten token-id lists."""
    n = 10
    want = st.encode([INPUT_TEXT] * n)
    for given in ([INPUT_TEXT] * n, [input_tokens] * n):
        answer = client.embeddings.create(model=MODEL, input=given, encoding_format="float")
        assert len(answer.data) == n
        assert len(answer.data[0].embedding) == DIM
        _check_usage(answer.usage, len(input_tokens) * n)
        assert_close([d.embedding for d in answer.data], want)


def test_truncate_prompt_tokens(client: openai.OpenAI, tokenizer: Any, backbone: Any) -> None:
    """vLLM's test_truncate_prompt_tokens: 10 tokens kept of a text and of token ids; above
    max_model_len a 400. The embeddings are also checked: the text's first 10 tokens (its
    special tokens kept), and the first 10 ids (vLLM keeps the last 10 of token ids; here ids
    follow truncation_side like text, docs/api.md, Inputs)."""
    text = "Como o Brasil pode fomentar o desenvolvimento de modelos de IA?"
    ids = list(tokenizer(text)["input_ids"])
    assert len(ids) > 10
    cut = list(tokenizer(text, truncation=True, max_length=10)["input_ids"])
    for given, kept in (([text], cut), (ids, ids[:10])):
        answer = client.embeddings.create(
            model=MODEL, input=given, extra_body={"truncate_prompt_tokens": 10}
        )
        assert len(answer.data) == 1
        assert len(answer.data[0].embedding) == DIM
        _check_usage(answer.usage, 10)
        assert_close(answer.data[0].embedding, _embedded(backbone, kept))

    with pytest.raises(openai.BadRequestError) as refused:
        client.embeddings.create(
            model=MODEL, input=[text], extra_body={"truncate_prompt_tokens": 8193}
        )
    assert TOO_BIG + SMALLER in refused.value.response.json()["error"]["message"]


def _chat_ids(tokenizer: Any, add_special_tokens: bool = False, **options: Any) -> list[int]:
    """The chat prompt as vLLM renders it: the template's text, tokenized without special tokens
    unless asked."""
    text = tokenizer.apply_chat_template(
        MESSAGES, chat_template=DUMMY_CHAT_TEMPLATE, tokenize=False, **options
    )
    return list(tokenizer(text, add_special_tokens=add_special_tokens)["input_ids"])


def test_chat_request(server: Any, client: openai.OpenAI, tokenizer: Any, backbone: Any) -> None:
    """vLLM's test_chat_request: `messages` equals its rendered prompt sent as text without
    special tokens; each option's token count (vLLM's 34, 33 and 36 are its tokenizer's counts:
    here the same conversation's under MiniLM's tokenizer); both options together refused."""
    chat = _post(server, messages=MESSAGES, encoding_format="float").json()
    prompt = tokenizer.apply_chat_template(
        MESSAGES,
        chat_template=DUMMY_CHAT_TEMPLATE,
        add_generation_prompt=True,
        continue_final_message=False,
        tokenize=False,
    )
    completion = client.embeddings.create(
        model=MODEL, input=prompt, encoding_format="float", extra_body={"add_special_tokens": False}
    ).model_dump(mode="json")
    assert chat["id"] and completion["id"]
    assert chat["created"] <= completion["created"]
    check_embeddings_close(
        [d["embedding"] for d in chat["data"]], [d["embedding"] for d in completion["data"]]
    )
    ignored = ("id", "created", "data")
    assert {k: v for k, v in chat.items() if k not in ignored} == {
        k: v for k, v in completion.items() if k not in ignored
    }
    assert_close(chat["data"][0]["embedding"], _embedded(backbone, _chat_ids(tokenizer)))

    for options in (
        {"add_generation_prompt": True},
        {"continue_final_message": True},
        {"add_special_tokens": True},
    ):
        output = _post(server, messages=MESSAGES, **options).json()
        assert output["object"] == "list"
        assert len(output["data"]) == 1
        assert output["model"] == MODEL
        assert output["usage"]["prompt_tokens"] == len(_chat_ids(tokenizer, **options))

    both = {"continue_final_message": True, "add_generation_prompt": True}
    response = server.post("/v1/embeddings", json={"model": MODEL, "messages": MESSAGES, **both})
    assert response.status_code == 400
    message = "Cannot set both `continue_final_message` and `add_generation_prompt` to True."
    assert message in response.json()["error"]["message"]


@pytest.mark.parametrize(
    "body",
    [{"input": INPUT_TEXT}, {"messages": MESSAGES}],
    ids=["completion", "chat"],
)
def test_invocations(server: Any, body: dict[str, Any]) -> None:
    """vLLM's test_invocations_completion_request and test_invocations_chat_request: SageMaker's
    /invocations answers an embeddings body as /v1/embeddings."""
    embedded = _post(server, encoding_format="float", **body).json()
    invoked = _post(server, "/invocations", encoding_format="float", **body).json()
    assert embedded.keys() == invoked.keys()
    for ours, theirs in zip(embedded["data"], invoked["data"], strict=True):
        assert ours.keys() == theirs.keys()
        check_embeddings_close([ours["embedding"]], [theirs["embedding"]])


def test_base64_embedding(client: openai.OpenAI, st: SentenceTransformer) -> None:
    """vLLM's test_base64_embedding: float, base64 and the client's default (base64, decoded by
    the client) all equal sentence-transformers."""
    texts = [
        "Hello my name is",
        "The best thing about vLLM is that it supports many different models",
    ]
    want = st.encode(texts)
    floats = client.embeddings.create(input=texts, model=MODEL, encoding_format="float")
    assert_close([d.embedding for d in floats.data], want)
    encoded = client.embeddings.create(input=texts, model=MODEL, encoding_format="base64")
    decoded = [
        np.frombuffer(base64.b64decode(str(d.embedding)), dtype="float32") for d in encoded.data
    ]
    assert_close(decoded, want)
    default = client.embeddings.create(input=texts, model=MODEL)
    assert_close([d.embedding for d in default.data], want)


def _floats(server: Any, texts: list[str]) -> list[list[float]]:
    document = _post(server, input=texts, encoding_format="float").json()
    return [d["embedding"] for d in document["data"]]


def test_base64_embed_dtype_and_endianness(server: Any) -> None:
    """vLLM's test_base64_embed_dtype_and_endianness: every embed_dtype in every byte order."""
    texts = [INPUT_TEXT] * 3
    floats = _floats(server, texts)
    for dtype in EMBED_DTYPES:
        for endianness in ENDIANNESS:
            body = {"encoding_format": "base64", "embed_dtype": dtype, "endianness": endianness}
            data = _post(server, input=texts, **body).json()["data"]
            decoded = [decode(base64.b64decode(d["embedding"]), dtype, endianness) for d in data]
            check_embeddings_close(floats, decoded, tol=1e-2)


def test_bytes_embed_dtype_and_endianness(server: Any) -> None:
    """vLLM's test_bytes_embed_dtype_and_endianness: the body cut by the `metadata` header."""
    texts = [INPUT_TEXT] * 3
    floats = _floats(server, texts)
    for dtype in EMBED_DTYPES:
        for endianness in ENDIANNESS:
            body = {"encoding_format": "bytes", "embed_dtype": dtype, "endianness": endianness}
            response = _post(server, input=texts, **body)
            items = json.loads(response.headers["metadata"])["data"]
            decoded = [
                decode(response.content[i["start"] : i["end"]], i["embed_dtype"], i["endianness"])
                for i in items
            ]
            check_embeddings_close(floats, decoded, tol=1e-2)


def test_bytes_only_embed_dtype_and_endianness(server: Any) -> None:
    """vLLM's test_bytes_only_embed_dtype_and_endianness: no header; the client cuts the body
    by the embedding size it knows."""
    texts = [INPUT_TEXT] * 2
    floats = _floats(server, texts)
    for dtype in EMBED_DTYPES:
        for endianness in ENDIANNESS:
            body = {"encoding_format": "bytes_only", "embed_dtype": dtype, "endianness": endianness}
            response = _post(server, input=texts, **body)
            assert "metadata" not in response.headers
            values = decode(response.content, dtype, endianness).reshape(len(texts), DIM)
            check_embeddings_close(floats, list(values), tol=1e-2)


@pytest.mark.parametrize("param_name", ["encoding_format", "embed_dtype", "endianness"])
def test_params_not_supported(server: Any, param_name: str) -> None:
    """vLLM's test_params_not_supported: a 400 naming the value sent. Difference kept: vLLM's
    message is pydantic's error list ("literal_error" in it); this server's is one line naming
    the field, the accepted values and the value (docs/api.md, /pooling differences)."""
    body = {"model": MODEL, "input": INPUT_TEXT, "encoding_format": "base64"}
    response = server.post("/v1/embeddings", json={**body, param_name: f"bad_{param_name}"})
    assert response.status_code == 400
    error = response.json()["error"]
    assert "literal_error" not in error["message"]
    assert f"bad_{param_name}" in error["message"]
    assert error["param"] == param_name


def test_use_activation(server: Any, backbone: Any, input_tokens: list[int]) -> None:
    """vLLM's test_use_activation: normalized by default and with true; false gives the mean
    pooled states as they are (checked against transformers too)."""

    def outputs(use_activation: bool | None) -> torch.Tensor:
        body = {"input": INPUT_TEXT, "encoding_format": "float", "use_activation": use_activation}
        return torch.tensor([d["embedding"] for d in _post(server, **body).json()["data"]])

    default, normalized, raw = outputs(None), outputs(True), outputs(False)
    assert torch.allclose(default, normalized, atol=1e-2)
    assert not torch.allclose(normalized, raw, atol=1e-2)
    assert torch.allclose(normalized, F.normalize(raw, p=2, dim=-1), atol=1e-2)
    assert_close(raw[0], _mean(backbone, input_tokens))


def test_pooling_embed(server: Any, st: SentenceTransformer) -> None:
    """vLLM's test_pooling_embed: /pooling with task embed, one 384-wide vector."""
    body = {"input": INPUT_TEXT, "encoding_format": "float", "task": "embed"}
    data = _post(server, "/pooling", **body).json()["data"]
    assert len(data) == 1
    assert len(data[0]["data"]) == DIM
    assert_close(data[0]["data"], st.encode(INPUT_TEXT))


def test_pooling_token_embed(server: Any, backbone: Any, input_tokens: list[int]) -> None:
    """vLLM's test_pooling_token_embed: one 384-wide vector per token (each unit length)."""
    body = {"input": INPUT_TEXT, "encoding_format": "float", "task": "token_embed"}
    data = _post(server, "/pooling", **body).json()["data"]
    assert len(data) == 1
    assert len(data[0]["data"]) == len(input_tokens)
    assert len(data[0]["data"][0]) == DIM
    with torch.inference_mode():
        hidden = backbone(input_ids=torch.tensor([input_tokens])).last_hidden_state[0]
    assert_close(data[0]["data"], F.normalize(hidden, dim=-1))


@pytest.mark.parametrize("task", ["classify", "token_classify", "plugin"])
def test_pooling_not_supported(server: Any, task: str) -> None:
    """vLLM's test_pooling_not_supported. Differences kept (docs/api.md, classify): the error
    type is OpenAI's `invalid_request_error` (vLLM: `BadRequestError`); `plugin` is no task of
    this server, so the body's schema refuses it (param `task`)."""
    body = {"model": MODEL, "input": "test", "encoding_format": "float", "task": task}
    response = server.post("/pooling", json=body)
    assert response.status_code == 400
    error = response.json()["error"]
    assert error["type"] == "invalid_request_error"
    if task == "plugin":
        assert error["param"] == "task", error
    else:
        assert error["message"].startswith(f"Unsupported task: {task!r}"), error


# embed/test_usage_policy.py


def test_usage_is_always_reported(client: openai.OpenAI) -> None:
    """vLLM's TestUsagePolicyDefault: one input and a batch both report usage."""
    for given in ("Hello world", ["Hello", "World"]):
        answer = client.embeddings.create(model=MODEL, input=given, encoding_format="float")
        assert answer.usage is not None
        assert answer.usage.prompt_tokens > 0
        assert answer.usage.completion_tokens == 0  # type: ignore[attr-defined]
        assert answer.usage.total_tokens == answer.usage.prompt_tokens


# basic/test_truncation.py: all-MiniLM-L12-v2 at --max-model-len 128

# vLLM's input is a paragraph on the history of calculus; any text above 128 tokens does
HISTORY = (
    "The printing press changed how knowledge travelled across Europe. Before it, books were "
    "copied by hand in monasteries and workshops, a slow and costly craft that kept them rare. "
    "Around 1440 Johannes Gutenberg combined movable metal type, an oil-based ink and a screw "
    "press adapted from wine making, and within fifty years presses were running in more than "
    "two hundred cities. Pamphlets, calendars, grammars and scientific treatises spread faster "
    "than any censor could follow, prices fell, literacy rose, and scholars in distant cities "
    "could for the first time argue over exactly the same page of exactly the same edition. "
    "Within a century the printed word had reshaped religion, science and politics alike."
)


@pytest.fixture(scope="module")
def short_server(live_servers: LiveServers, model_dir: Path) -> httpx.Client:
    return live_servers.serve(model_dir, MODEL, max_model_len=128)


def test_truncation_sizes(short_server: Any, tokenizer: Any) -> None:
    """vLLM's test_smaller_truncation_size, test_bigger_truncation_size and
    test_max_truncation_size: 10 tokens, max_model_len + 1 (refused with vLLM's message; the
    error type is this server's, docs/api.md), and -1 (the model's 128)."""
    assert len(tokenizer(HISTORY)["input_ids"]) > 128
    body = {"model": MODEL, "input": HISTORY}
    for size, tokens in ((10, 10), (-1, 128)):
        answer = short_server.post("/v1/embeddings", json={**body, "truncate_prompt_tokens": size})
        assert answer.status_code == 200, answer.text
        assert answer.json()["usage"]["prompt_tokens"] == tokens
    refused = short_server.post("/v1/embeddings", json={**body, "truncate_prompt_tokens": 129})
    assert refused.status_code == 400
    error = refused.json()["error"]
    assert error["type"] == "invalid_request_error"
    assert error["message"].startswith(TOO_BIG + SMALLER), error


# embed/test_online_dimensions.py


@contextmanager
def _refused() -> Iterator[None]:
    with pytest.raises(openai.BadRequestError) as refused:
        yield
    assert refused.value.response.json()["error"]["param"] == "dimensions"


def _matryoshka_request(
    client: openai.OpenAI, st: SentenceTransformer, dimensions: int | None
) -> None:
    """vLLM's make_request_and_correctness_test: three inputs, each of `dimensions` values,
    equal to sentence-transformers cut there and normalized."""
    prompts = ["The chef prepared a delicious meal."] * 3
    extra = {} if dimensions is None else {"dimensions": dimensions}
    answer = client.embeddings.create(
        model=MODEL, input=prompts, encoding_format="float", extra_body=extra
    )
    assert answer.id is not None  # type: ignore[attr-defined]
    assert len(answer.data) == 3
    assert len(answer.data[0].embedding) == (dimensions or DIM)
    assert answer.usage.completion_tokens == 0  # type: ignore[attr-defined]
    assert answer.usage.prompt_tokens > 0 and answer.usage.total_tokens > 0
    want = st.encode(prompts, normalize_embeddings=True)[:, : dimensions or DIM]
    assert_close([d.embedding for d in answer.data], want / np.linalg.norm(want, axis=1)[:, None])


def test_dimensions_on_a_model_without_matryoshka(
    client: openai.OpenAI, st: SentenceTransformer
) -> None:
    """vLLM's test_matryoshka on multilingual-e5-small: no dimensions answer; -1 and 16 are
    400s."""
    _matryoshka_request(client, st, None)
    for dimensions in (-1, 16):
        with _refused():
            _matryoshka_request(client, st, dimensions)


@pytest.fixture(scope="module")
def matryoshka(live_servers: LiveServers, model_dir: Path) -> openai.OpenAI:
    # vLLM: snowflake-arctic-embed-m-v1.5 --hf_overrides '{"matryoshka_dimensions":[256]}'
    overrides = json.dumps({"matryoshka_dimensions": [256]})
    return _openai(live_servers.serve(model_dir, MODEL, hf_overrides=overrides))


def test_dimensions_on_a_matryoshka_model(
    matryoshka: openai.OpenAI, st: SentenceTransformer
) -> None:
    """vLLM's test_matryoshka on a model declaring [256]: none and 256 answer, equal to
    sentence-transformers cut at 256 and normalized; -1 and 5 are 400s."""
    for dimensions in (None, 256):
        _matryoshka_request(matryoshka, st, dimensions)
    for refused in (-1, 5):
        with _refused():
            _matryoshka_request(matryoshka, st, refused)


# embed/test_online_long_text.py: --pooler-config with enable_chunked_processing

WORDS = (  # noqa: SIM905 (a list of 45 words reads better as text)
    "river stone signal garden engine lantern harbor market circuit meadow pattern summit "
    "archive compass theory window forest ledger canvas rocket island bridge mirror castle "
    "design measure observe gather improve deliver explain connect balance protect travel "
    "the and they this those into with across under beyond"
).split()


def _long_text(word_count: int, seed: int) -> str:
    """About `word_count` words drawn at random (seeded), a full stop every 10 to 20 words."""
    rng = random.Random(seed)
    words = [rng.choice(WORDS) for _ in range(word_count)]
    stops = set()
    at = 0
    while at < word_count - 1:
        at += rng.randint(10, 20)
        stops.add(at - 1)
    return " ".join(w + "." if i in stops else w for i, w in enumerate(words))


LONG_1500 = _long_text(1500, seed=1)
LONG_2500 = _long_text(2500, seed=2)
SHORT = (
    "Artificial intelligence technology is changing our world, bringing unprecedented "
    "opportunities and challenges."
)
CHUNKED = json.dumps(
    {
        "pooling_type": "MEAN",
        "use_activation": True,
        "enable_chunked_processing": True,
        "max_embed_len": 10000,
    }
)


@pytest.fixture(scope="module")
def chunked(live_servers: LiveServers, minilm_dir: Path) -> openai.OpenAI:
    # vLLM: --max-model-len 512 --pooler-config CHUNKED
    return _openai(live_servers.serve(minilm_dir, MODEL, max_model_len=512, pooler_config=CHUNKED))


def _chunked_reference(backbone: Any, tokenizer: Any, text: str) -> torch.Tensor:
    """vLLM's chunked processing by hand: the prompt's ids cut into consecutive slices of the
    model's length (MiniLM's max_seq_length, 256, caps the 512), each slice mean-pooled and
    normalized, averaged with its token count as the weight, normalized again (docs/jobs.md)."""
    ids = list(tokenizer(text)["input_ids"])
    slices = [ids[i : i + 256] for i in range(0, len(ids), 256)]
    total = sum(len(s) * _embedded(backbone, s) for s in slices)
    assert isinstance(total, torch.Tensor)
    return F.normalize(total / len(ids), dim=-1)


def _check_vector(vector: list[float]) -> None:
    assert len(vector) == DIM
    assert all(isinstance(x, float) for x in vector)
    assert any(x != 0 for x in vector)


@pytest.mark.parametrize(("text", "least"), [(LONG_1500, 800), (LONG_2500, 1500)])
def test_long_text_embedding(
    chunked: openai.OpenAI, backbone: Any, tokenizer: Any, text: str, least: int
) -> None:
    """vLLM's test_long_text_embedding_1500_chars and _2500_chars: one vector for a text of
    several times the model's length, usage its whole token count (checked here against the
    chunked average computed with transformers)."""
    assert len(text.split()) >= (1400 if least == 800 else 2300)
    answer = chunked.embeddings.create(model=MODEL, input=[text], encoding_format="float")
    assert answer.id is not None  # type: ignore[attr-defined]
    assert len(answer.data) == 1
    _check_vector(answer.data[0].embedding)
    assert answer.usage.completion_tokens == 0  # type: ignore[attr-defined]
    assert answer.usage.prompt_tokens > least
    assert answer.usage.prompt_tokens == len(tokenizer(text)["input_ids"])
    assert answer.usage.total_tokens == answer.usage.prompt_tokens
    assert_close(answer.data[0].embedding, _chunked_reference(backbone, tokenizer, text))


def test_batch_long_text_embedding(chunked: openai.OpenAI) -> None:
    """vLLM's test_batch_long_text_embedding: two long texts and a short one, in order."""
    texts = [LONG_1500, LONG_2500, "This is a short text test."]
    answer = chunked.embeddings.create(model=MODEL, input=texts, encoding_format="float")
    assert len(answer.data) == 3
    for i, item in enumerate(answer.data):
        assert item.index == i
        _check_vector(item.embedding)
    assert answer.usage.completion_tokens == 0  # type: ignore[attr-defined]
    assert answer.usage.prompt_tokens > 1000
    assert answer.usage.total_tokens == answer.usage.prompt_tokens


def test_chunked_vs_normal_consistency(chunked: openai.OpenAI, st: SentenceTransformer) -> None:
    """vLLM's test_chunked_vs_normal_consistency: a short text is one slice (equal to
    sentence-transformers here)."""
    answer = chunked.embeddings.create(model=MODEL, input=[SHORT], encoding_format="float")
    assert len(answer.data) == 1
    _check_vector(answer.data[0].embedding)
    assert answer.usage.prompt_tokens < 512
    assert answer.usage.total_tokens == answer.usage.prompt_tokens
    assert_close(answer.data[0].embedding, st.encode(SHORT))


def test_chunked_processing_response_format(chunked: openai.OpenAI) -> None:
    """vLLM's test_chunked_processing_response_format: the item's fields; the vector normalized."""
    answer = chunked.embeddings.create(model=MODEL, input=[LONG_1500], encoding_format="float")
    assert len(answer.data) == 1
    assert answer.data[0].object == "embedding"
    assert answer.data[0].index == 0
    assert 0.8 < float(np.linalg.norm(answer.data[0].embedding)) < 1.2
