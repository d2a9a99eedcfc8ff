"""LoRA adapters through the real app: listed in /v1/models with their base as parent (vLLM's
cards), reached by the request's `model` on every route, answered under the adapter's name, and
equal to PEFT's model with that adapter (tests/models/test_lora.py covers mixing and chunking)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import torch
from peft import LoraConfig
from starlette.testclient import TestClient

from poolserve.config.settings import ServerSettings
from poolserve.http.app import create_app
from tests.models.test_lora import TOLERANCE, _random_adapter, _states
from tests.tiny_encoders import build_hf_encoder, save_tiny_encoder

BASE = "tiny-bert"
TEXT = "the quick brown fox jumps over the lazy dog"
CONFIGS = {
    "legal": LoraConfig(r=4, lora_alpha=8, target_modules=["query", "value", "output.dense"]),
    "medical": LoraConfig(r=2, lora_alpha=2, target_modules=["key", "intermediate.dense"]),
}


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[TestClient, dict, dict]]:
    directory = tmp_path_factory.mktemp("lora-served")
    base = build_hf_encoder("bert")
    path = save_tiny_encoder("bert", directory / "base", base)
    references: dict[str, torch.nn.Module] = {BASE: base}
    folders: dict[str, Path] = {}
    for seed, (name, config) in enumerate(CONFIGS.items()):
        references[name] = _random_adapter(base, config, seed)
        folders[name] = directory / name
        references[name].save_pretrained(folders[name])
    settings = ServerSettings(
        model=str(path),
        served_model_name=[BASE],
        lora_modules=[f"{name}={folder}" for name, folder in folders.items()],
        max_loras=2,
    )
    with TestClient(create_app(settings)) as client:
        yield client, references, folders


def test_models_lists_each_adapter_with_its_base(served: tuple[TestClient, dict, dict]) -> None:
    client, _, folders = served
    cards = {card["id"]: card for card in client.get("/v1/models").json()["data"]}
    assert set(cards) == {BASE, *folders}
    assert "parent" not in cards[BASE]
    for name, folder in folders.items():
        assert cards[name]["parent"] == BASE
        assert cards[name]["root"] == str(folder)


def test_each_adapter_answers_as_peft_does(served: tuple[TestClient, dict, dict]) -> None:
    client, references, _ = served
    tokens = client.post("/tokenize", json={"prompt": TEXT}).json()["tokens"]
    vectors = {}
    for name, reference in references.items():
        body = {"model": name, "input": TEXT, "task": "token_embed", "normalize": False}
        pooled = client.post("/v1/pooling", json=body)
        assert pooled.status_code == 200, pooled.text
        assert pooled.json()["model"] == name
        got = np.asarray(pooled.json()["data"][0]["data"], dtype=np.float32)
        want = _states(reference, tokens)
        assert float(np.abs(got - want).max()) <= TOLERANCE * max(1.0, float(np.abs(want).max()))
        embedded = client.post("/v1/embeddings", json={"model": name, "input": TEXT})
        assert embedded.status_code == 200, embedded.text
        assert embedded.json()["model"] == name
        vectors[name] = np.asarray(embedded.json()["data"][0]["embedding"])
    for name in CONFIGS:  # each adapter's embedding is its own, never the base's
        assert float(np.abs(vectors[name] - vectors[BASE]).max()) > 1e-3


def test_an_unknown_adapter_is_a_404_listing_the_adapters(
    served: tuple[TestClient, dict, dict],
) -> None:
    client, _, _ = served
    response = client.post("/v1/embeddings", json={"model": "finance", "input": TEXT})
    assert response.status_code == 404
    assert "legal" in response.json()["error"]["message"]
