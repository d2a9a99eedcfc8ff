"""Each endpoint and task end to end through the app, equal to the Hugging Face reference."""

from __future__ import annotations

import base64
from collections.abc import Callable
from typing import Any

import numpy as np
import orjson
import pytest
import torch
from sentence_transformers import SentenceTransformer

from tests.http.serving import assert_close, hf_hidden, hf_logits
from tests.tiny_models import MINILM_DIR, reference_remote_head

TEXTS = ["hello world", "a much longer sentence about pooling services and their outputs " * 3, "x"]


def _ids(client: Any, text: str) -> list[int]:
    return list(client.post("/tokenize", json={"prompt": text}).json()["tokens"])


def _normalize(t: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.normalize(t, dim=-1)


def _pool(client: Any, **body: Any) -> list[Any]:
    response = client.post("/v1/pooling", json=body)
    assert response.status_code == 200, response.text
    return [item["data"] for item in response.json()["data"]]


def test_embeddings_minilm_equal_sentence_transformers(make_client: Callable[..., Any]) -> None:
    reference = SentenceTransformer(str(MINILM_DIR), device="cpu").encode(
        TEXTS, convert_to_numpy=True
    )
    with make_client(None) as client:
        for fmt in ("float", "base64"):
            response = client.post("/v1/embeddings", json={"input": TEXTS, "encoding_format": fmt})
            assert response.status_code == 200, response.text
            body = response.json()
            assert body["object"] == "list" and body["model"] == "minilm"
            assert body["usage"]["prompt_tokens"] == body["usage"]["total_tokens"] > 0
            for item, want in zip(body["data"], reference, strict=True):
                assert item["object"] == "embedding"
                vec = item["embedding"]
                if fmt == "base64":
                    vec = np.frombuffer(base64.b64decode(vec), dtype="<f4")
                assert_close(vec, want)


def test_decoder_embed_and_token_embed(make_client: Callable[..., Any]) -> None:
    with make_client("llama") as client:
        ids = [_ids(client, t) for t in TEXTS]
        embeds = _pool(client, input=TEXTS, task="embed")
        tokens = _pool(client, input=TEXTS, task="token_embed", normalize=False)
        dims = _pool(client, input=TEXTS[:1], task="embed", normalize=False)
    for prompt, emb, tok in zip(ids, embeds, tokens, strict=True):
        hidden = hf_hidden("llama", prompt)
        assert_close(emb, _normalize(hidden[-1]))
        assert_close(tok, hidden)
    assert_close(dims[0], hf_hidden("llama", ids[0])[-1])


def test_classify_labels_and_probs(make_client: Callable[..., Any]) -> None:
    with make_client("llama_cls3") as client:
        ids = [_ids(client, t) for t in TEXTS]
        response = client.post("/v1/classify", json={"input": TEXTS})
        raw = _pool(client, input=TEXTS, task="classify", use_activation=False)
    assert response.status_code == 200, response.text
    for prompt, item, logits in zip(ids, response.json()["data"], raw, strict=True):
        want = hf_logits("llama_cls3", prompt)  # already pooled at the last token
        assert_close(item["probs"], torch.softmax(want, -1))
        assert item["num_classes"] == 3
        assert item["label"] == ["negative", "neutral", "positive"][int(want.argmax())]
        assert_close(logits, want)


def test_sequence_reward_is_the_raw_score(make_client: Callable[..., Any]) -> None:
    with make_client("llama_cls1") as client:
        ids = _ids(client, TEXTS[1])
        (reward,) = _pool(client, input=TEXTS[1], task="reward")
    assert_close(reward, hf_logits("llama_cls1", ids))


def test_token_classify_and_embed_token_classify(make_client: Callable[..., Any]) -> None:
    with make_client("qwen2_tokcls") as client:
        ids = _ids(client, TEXTS[1])
        (probs,) = _pool(client, input=TEXTS[1], task="token_classify")
        (joint,) = _pool(client, input=TEXTS[1], task="embed&token_classify")
    want = torch.softmax(hf_logits("qwen2_tokcls", ids), -1)
    assert_close(probs, want)
    embedding = _normalize(hf_hidden("qwen2_tokcls", ids)[-1])
    assert_close(joint, torch.cat([embedding, want.flatten()]))


def test_process_reward_at_step_tags(make_client: Callable[..., Any]) -> None:
    with make_client("qwen2_prm") as client:
        ids = _ids(client, "step one . step two . done .")
        tag = ids[3]
        (rewards,) = _pool(client, input=[ids], task="reward", step_tag_id=tag)
    hidden = hf_hidden("qwen2_prm", ids)
    positions = [i for i, t in enumerate(ids) if t == tag]
    want = torch.softmax(reference_remote_head("qwen2_prm")(hidden[positions]), -1)
    assert_close(rewards, want)


@pytest.mark.parametrize("fmt", ["float", "base64"])
def test_stream_lines_equal_the_plain_response(make_client: Callable[..., Any], fmt: str) -> None:
    long_text = " ".join(f"word{i}" for i in range(150))  # over 300 tokens
    texts = [long_text, *TEXTS]
    with make_client("llama", max_num_batched_tokens=128) as client:
        plain = _pool(client, input=texts, task="token_embed", encoding_format=fmt)
        with client.stream(
            "POST",
            "/v1/pooling",
            json={"input": texts, "task": "token_embed", "stream": True, "encoding_format": fmt},
        ) as response:
            assert response.headers["content-type"].startswith("application/x-ndjson")
            lines = [orjson.loads(line) for line in response.iter_lines() if line]
    *items, usage = lines
    assert usage["usage"]["prompt_tokens"] > 300
    assert sorted(i["index"] for i in items) == list(range(len(texts)))
    for item in items:
        got, want = item["data"], plain[item["index"]]
        if fmt == "base64":
            got = np.frombuffer(base64.b64decode(got), "<f4")
            want = np.frombuffer(base64.b64decode(want), "<f4")
            assert item["shape"][0] > 0
        assert_close(got, np.asarray(want, dtype=np.float32))


@pytest.mark.parametrize("dtype,np_dtype", [("float16", "<f2"), ("float32", "<f4")])
def test_base64_embed_dtype(make_client: Callable[..., Any], dtype: str, np_dtype: str) -> None:
    with make_client("llama") as client:
        (floats,) = _pool(client, input="hello", task="embed")
        (encoded,) = _pool(
            client, input="hello", task="embed", encoding_format="base64", embed_dtype=dtype
        )
    decoded = np.frombuffer(base64.b64decode(encoded), np_dtype).astype(np.float32)
    assert np.abs(decoded - np.asarray(floats)).max() <= (1e-3 if dtype == "float16" else 1e-7)


def test_bfloat16_base64_round_trips(make_client: Callable[..., Any]) -> None:
    with make_client("llama") as client:
        (floats,) = _pool(client, input="hello", task="embed")
        (encoded,) = _pool(
            client, input="hello", task="embed", encoding_format="base64", embed_dtype="bfloat16"
        )
    raw = np.frombuffer(base64.b64decode(encoded), "<u2").astype(np.uint32) << 16
    decoded = raw.view(np.float32)
    assert np.abs(decoded - np.asarray(floats)).max() <= 1e-2


def test_tokenize_detokenize_models_info(make_client: Callable[..., Any]) -> None:
    with make_client("qwen3", api_key=None) as client:
        tokens = client.post("/tokenize", json={"prompt": "hello world"}).json()
        assert tokens["count"] == len(tokens["tokens"])
        text = client.post("/detokenize", json={"tokens": tokens["tokens"]}).json()["prompt"]
        assert "hello world" in text
        assert client.get("/v1/models").json()["data"][0]["id"] == "qwen3"
        info = client.get("/info").json()
        assert set(info["tasks"]) == {"embed", "token_embed"} and info["device"] == "cpu"
        assert client.get("/health").status_code == 200 and client.get("/ready").status_code == 200


def test_headers_echo_request_id_and_timings(make_client: Callable[..., Any]) -> None:
    with make_client("llama") as client:
        response = client.post(
            "/v1/embeddings", json={"input": "hi"}, headers={"x-request-id": "abc-123"}
        )
    assert response.headers["x-request-id"] == "abc-123"
    assert float(response.headers["x-queue-time"]) >= 0
    assert float(response.headers["x-inference-time"]) >= 0
