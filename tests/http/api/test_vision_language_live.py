"""A vision-language embedder (tiny Qwen3-VL: deepstack, interleaved M-RoPE) served by a real
`poolserve serve` process: vLLM's chat embeddings with image_url parts (data URLs), sent at once
from several clients so their prompts share steps, chunked (a small token budget splits prompts
and images across steps), each equal to transformers; the official `cohere` client's image
embeddings; the 400s a client meets before any engine work."""

from __future__ import annotations

import base64
import io
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import cohere
import httpx
import numpy as np
import pytest
from PIL import Image

from tests.http.test_server_process import free_port, start_server
from tests.tiny_vl import Reference, image, save_tiny_vl

pytestmark = pytest.mark.slow
API_KEY = "vl-key"
SIZES = ((60, 40), (33, 90), (120, 120), (28, 28))


def _data_url(picture: Image.Image) -> str:
    buffer = io.BytesIO()
    picture.save(buffer, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode()


def _close(got: Any, want: np.ndarray) -> None:
    got = np.asarray(got, dtype=np.float32)
    assert got.shape == want.shape
    assert float(np.abs(got - want).max()) <= 1e-4 * float(np.abs(want).max())


def _unit(row: np.ndarray) -> np.ndarray:
    return row / np.linalg.norm(row)


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, Reference]]:
    directory: Path = save_tiny_vl("qwen3_vl", tmp_path_factory.mktemp("qwen3_vl"))
    port = free_port()
    args = ("--model", str(directory), "--served-model-name", "vl", "--api-key", API_KEY)
    budget = ("--max-num-batched-tokens", "16", "--long-prefill-token-threshold", "6")
    process = start_server(port, *args, *budget)
    try:
        yield f"http://127.0.0.1:{port}", Reference(directory)
    finally:
        process.terminate()
        process.wait(30)


def _conversation(index: int) -> tuple[list[dict[str, Any]], list[Image.Image]]:
    """A user message of text and one or two images, different per index."""
    pictures = [
        image(*SIZES[(index + k) % len(SIZES)], seed=index * 7 + k) for k in range(1 + index % 2)
    ]
    parts: list[dict[str, Any]] = [{"type": "text", "text": f"w{index} w{index + 1}"}]
    for picture in pictures:
        parts.append({"type": "image_url", "image_url": {"url": _data_url(picture)}})
        parts.append({"type": "text", "text": f"w{index + 2}"})
    return [{"role": "user", "content": parts}], pictures


def _reference_parts(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The same conversation as transformers' chat template takes it (images as image parts)."""
    return [
        {
            "role": m["role"],
            "content": [{"type": "image"} if p["type"] == "image_url" else p for p in m["content"]],
        }
        for m in messages
    ]


def test_concurrent_chat_embeddings_with_images_equal_transformers(
    served: tuple[str, Reference],
) -> None:
    base, reference = served
    conversations = [_conversation(i) for i in range(6)]

    def embed(conversation: list[dict[str, Any]]) -> list[float]:
        body = {"model": "vl", "messages": conversation, "normalize": False}
        reply = httpx.post(
            f"{base}/v1/embeddings",
            json=body,
            headers={"authorization": f"Bearer {API_KEY}"},
            timeout=60,
        )
        assert reply.status_code == 200, reply.text
        embedding: list[float] = reply.json()["data"][0]["embedding"]
        return embedding

    with ThreadPoolExecutor(len(conversations)) as pool:
        answers = list(pool.map(embed, [messages for messages, _ in conversations]))
    for (messages, pictures), got in zip(conversations, answers, strict=True):
        text = reference.render(_reference_parts(messages))
        _close(got, reference.last_hidden(text, pictures).numpy())


def test_cohere_client_embeds_images(served: tuple[str, Reference]) -> None:
    base, reference = served
    pictures = [image(*SIZES[k], seed=40 + k) for k in range(2)]
    client = cohere.ClientV2(base_url=base, api_key=API_KEY)
    answer = client.embed(
        model="vl",
        images=[_data_url(p) for p in pictures],
        input_type="image",
        embedding_types=["float"],
    )
    floats = answer.embeddings.float_
    assert floats is not None and len(floats) == 2
    for picture, got in zip(pictures, floats, strict=True):
        text = reference.render([{"role": "user", "content": [{"type": "image"}]}])
        _close(got, _unit(reference.last_hidden(text, [picture]).numpy()))


def test_what_a_client_gets_wrong_is_a_400_and_the_model_says_it_takes_images(
    served: tuple[str, Reference],
) -> None:
    base, _ = served
    headers = {"authorization": f"Bearer {API_KEY}"}
    broken = {"type": "image_url", "image_url": {"url": "data:image/png;base64,bm90IGFuIGltYWdl"}}
    typed = {"type": "text", "text": "w1 <|image_pad|> w2"}  # a text writing the placeholder
    for part in (broken, typed):
        body = {"model": "vl", "messages": [{"role": "user", "content": [part]}]}
        reply = httpx.post(f"{base}/v1/embeddings", json=body, headers=headers, timeout=60)
        assert reply.status_code == 400, reply.text
        assert reply.json()["error"]["type"] == "invalid_request_error"
    ok = {"model": "vl", "messages": [{"role": "user", "content": "w1 w2"}]}
    assert httpx.post(f"{base}/v1/embeddings", json=ok, headers=headers).status_code == 200
    # the model says it takes images (its card's inline images)
    info = httpx.get(f"{base}/info", headers=headers).json()
    assert info["modalities"] == ["text", "image"]
