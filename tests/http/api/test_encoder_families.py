"""New encoder families served end to end: a DeBERTa-v3 reward model, ModernBERT embeddings."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from starlette.testclient import TestClient

from poolserve.config.settings import ServerSettings
from poolserve.http.app import create_app
from tests.http.serving import assert_close
from tests.tiny_encoders import build_hf_encoder, encoder_dirs

TEXTS = ["hello world", "a longer sentence about reward models and their scores " * 8, "x"]


@pytest.fixture(scope="module")
def serve(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], Any]:
    """serve(name) -> context manager yielding a started TestClient over that tiny encoder."""
    directory = encoder_dirs(tmp_path_factory)

    @contextmanager
    def make(name: str) -> Iterator[TestClient]:
        settings = ServerSettings(model=str(directory(name)), served_model_name=name)
        with TestClient(create_app(settings)) as client:
            yield client

    return make


def _ids(client: TestClient, text: str) -> list[int]:
    return list(client.post("/tokenize", json={"prompt": text}).json()["tokens"])


def test_deberta_v3_reward_scores_equal_hf(serve: Callable[[str], Any]) -> None:
    with serve("debertav3_reward") as client:
        ids = [_ids(client, text) for text in TEXTS]
        response = client.post("/v1/pooling", json={"input": TEXTS, "task": "reward"})
    assert response.status_code == 200, response.text
    model = build_hf_encoder("debertav3_reward")
    for prompt, item in zip(ids, response.json()["data"], strict=True):
        with torch.no_grad():
            assert_close(item["data"], model(input_ids=torch.tensor([prompt])).logits[0])


def test_modernbert_embeddings_equal_hf_cls(serve: Callable[[str], Any]) -> None:
    with serve("modernbert") as client:
        ids = [_ids(client, text) for text in TEXTS]
        response = client.post("/v1/embeddings", json={"input": TEXTS, "model": "modernbert"})
    assert response.status_code == 200, response.text
    model = build_hf_encoder("modernbert")
    for prompt, item in zip(ids, response.json()["data"], strict=True):
        with torch.no_grad():
            hidden = model(input_ids=torch.tensor([prompt])).last_hidden_state[0]
        # No sentence-transformers config: an encoder embeds its first token, normalised.
        assert_close(item["embedding"], F.normalize(hidden[0], dim=-1))


def test_modernbert_mean_classifier_pools_as_its_config_says(serve: Callable[[str], Any]) -> None:
    with serve("modernbert_mean") as client:
        ids = [_ids(client, text) for text in TEXTS]
        response = client.post(
            "/v1/pooling", json={"input": TEXTS, "task": "classify", "use_activation": False}
        )
    assert response.status_code == 200, response.text
    model = build_hf_encoder("modernbert_mean")
    assert model.config.classifier_pooling == "mean"
    for prompt, item in zip(ids, response.json()["data"], strict=True):
        with torch.no_grad():
            assert_close(item["data"], model(input_ids=torch.tensor([prompt])).logits[0])
