"""New decoder families served end to end: a Gemma2 reward model, a bidirectional Gemma3."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import pytest
import torch
from starlette.testclient import TestClient

from poolserve.config.settings import ServerSettings
from poolserve.http.app import create_app
from tests.http.serving import assert_close
from tests.tiny_decoders import build_hf_decoder, decoder_dirs

TEXTS = ["hello world", "a longer sentence about reward models and their scores " * 4, "x"]


@pytest.fixture(scope="module")
def serve(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], Any]:
    """serve(name) -> context manager yielding a started TestClient over that tiny decoder."""
    directory = decoder_dirs(tmp_path_factory)

    @contextmanager
    def make(name: str) -> Iterator[TestClient]:
        settings = ServerSettings(model=str(directory(name)), served_model_name=name)
        with TestClient(create_app(settings)) as client:
            yield client

    return make


def _pool(client: TestClient, **body: Any) -> list[Any]:
    response = client.post("/v1/pooling", json=body)
    assert response.status_code == 200, response.text
    return [item["data"] for item in response.json()["data"]]


def _ids(client: TestClient, text: str) -> list[int]:
    return list(client.post("/tokenize", json={"prompt": text}).json()["tokens"])


def test_gemma2_reward_model_scores_equal_hf(serve: Callable[[str], Any]) -> None:
    with serve("gemma2_reward") as client:
        ids = [_ids(client, text) for text in TEXTS]
        rewards = _pool(client, input=TEXTS, task="reward")
    model = build_hf_decoder("gemma2_reward")
    for prompt, reward in zip(ids, rewards, strict=True):
        with torch.no_grad():
            assert_close(reward, model(input_ids=torch.tensor([prompt])).logits[0])


def test_bidirectional_gemma3_token_embeddings_equal_hf(serve: Callable[[str], Any]) -> None:
    with serve("gemma3_bidir") as client:
        ids = [_ids(client, text) for text in TEXTS]
        tokens = _pool(client, input=TEXTS, task="token_embed", normalize=False)
    model = build_hf_decoder("gemma3_bidir")
    for prompt, hidden in zip(ids, tokens, strict=True):
        with torch.no_grad():
            assert_close(hidden, model(input_ids=torch.tensor([prompt])).last_hidden_state[0])
