"""--api-keys-file's `models` in the listing routes: each key sees only the models and LoRA
adapters it may use in OpenAI's /v1/models, Ollama's /api/tags, Infinity's /models, and the
routes that describe one model (/v1/models/{id}, Ollama's /api/show, /info) answer a model it
may not use as an unknown one, in words that name no other model. The app in process serves a
tiny encoder (two served names, two LoRA adapters; the default model) and a tiny cross-encoder.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
from peft import LoraConfig
from starlette.testclient import TestClient

from poolserve.config.settings import ServerSettings
from poolserve.http.app import create_app
from tests.models.test_lora import _random_adapter
from tests.tiny_encoders import build_hf_encoder, save_tiny_encoder
from tests.tiny_rerankers import save_cross_encoder

ENCODER = ("tiny-bert", "bert")  # its served names; the default model
ADAPTERS = ("legal", "medical")  # LoRA adapters on the encoder
RERANKER = "reranker"
SECRETS = {
    "everything": "sk-everything-0123456789",  # no `models`: every model
    "encoder": "sk-encoder-0123456789",  # the encoder by its second name
    "elsewhere": "sk-elsewhere-0123456789",  # one adapter and the reranker, not the default
}
KEYS_FILE = f"""
keys:
  - name: everything
    key: {SECRETS["everything"]}
  - name: encoder
    key: {SECRETS["encoder"]}
    models: [{ENCODER[1]}]
  - name: elsewhere
    key: {SECRETS["elsewhere"]}
    models: [{ADAPTERS[0]}, {RERANKER}]
"""
# what each key may use, as the listings name it
SEES = {
    "everything": {*ENCODER, *ADAPTERS, RERANKER},
    "encoder": set(ENCODER),  # both names of the model; an adapter only by its own name
    "elsewhere": {ADAPTERS[0], RERANKER},
}


def _auth(name: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {SECRETS[name]}"}


def _ok(response: Any) -> Any:
    assert response.status_code == 200, response.text
    return response.json()


@pytest.fixture(scope="module")
def client(tmp_path_factory: pytest.TempPathFactory) -> Iterator[TestClient]:
    directory = tmp_path_factory.mktemp("key-listings")
    base = build_hf_encoder("bert")
    encoder = save_tiny_encoder("bert", directory / "encoder", base)
    config = LoraConfig(r=2, lora_alpha=4, target_modules=["query", "value"])
    for seed, name in enumerate(ADAPTERS):
        _random_adapter(base, config, seed).save_pretrained(directory / name)
    reranker = save_cross_encoder("bert_cls", directory / RERANKER)
    loras = ", ".join(f"{name}={directory / name}" for name in ADAPTERS)
    models = directory / "models.yaml"
    models.write_text(
        f"""
models:
  - model: {encoder}
    served_model_name: [{", ".join(ENCODER)}]
    lora_modules: [{loras}]
  - model: {reranker}
    served_model_name: {RERANKER}
"""
    )
    keys = directory / "keys.yaml"
    keys.write_text(KEYS_FILE)
    settings = ServerSettings(models_config=str(models), api_keys_file=str(keys))
    with TestClient(create_app(settings)) as started:
        yield started


@pytest.mark.parametrize("key", sorted(SEES))
def test_each_key_lists_only_the_models_it_may_use(client: TestClient, key: str) -> None:
    headers = _auth(key)
    cards = {c["id"]: c for c in _ok(client.get("/v1/models", headers=headers))["data"]}
    assert set(cards) == SEES[key]
    for adapter in set(ADAPTERS) & SEES[key]:
        assert cards[adapter]["parent"] == ENCODER[0]  # vLLM's card, as without keys
    # Ollama and Infinity list served models (no adapters); Ollama each served name
    tags = _ok(client.get("/api/tags", headers=headers))["models"]
    assert {t["name"] for t in tags} == SEES[key] - set(ADAPTERS)
    infinity = _ok(client.get("/models", headers=headers))["data"]
    firsts = {ENCODER[0], RERANKER} & SEES[key]  # Infinity's card: the first served name
    assert {c["id"] for c in infinity} == firsts


def test_two_keys_see_different_lists(client: TestClient) -> None:
    def listed(key: str) -> list[str]:
        return [c["id"] for c in _ok(client.get("/v1/models", headers=_auth(key)))["data"]]

    assert listed("encoder") == list(ENCODER)
    assert listed("elsewhere") == [RERANKER, ADAPTERS[0]]  # models first, then adapters


def test_one_model_is_described_only_to_a_key_that_may_use_it(client: TestClient) -> None:
    everything, elsewhere = _auth("everything"), _auth("elsewhere")
    card = _ok(client.get(f"/v1/models/{ADAPTERS[0]}", headers=elsewhere))
    assert (card["id"], card["parent"]) == (ADAPTERS[0], ENCODER[0])
    assert _ok(client.get(f"/v1/models/{ENCODER[1]}", headers=everything))["id"] == ENCODER[1]
    # a model the key may not use is answered as an unknown name, in the same words
    hidden = client.get(f"/v1/models/{ENCODER[0]}", headers=elsewhere)
    unknown = client.get("/v1/models/no-such-model", headers=elsewhere)
    assert hidden.status_code == unknown.status_code == 404
    assert hidden.json()["error"]["code"] == "model_not_found"
    words = hidden.json()["error"]["message"].replace(ENCODER[0], "NAME")
    assert words == unknown.json()["error"]["message"].replace("no-such-model", "NAME")
    assert client.get("/v1/models/no-such-model", headers=everything).status_code == 404
    # Ollama's /api/show: its own 404 for both, `:latest` or not
    shown = _ok(client.post("/api/show", json={"model": f"{RERANKER}:latest"}, headers=elsewhere))
    assert shown["capabilities"] == ["embedding"]
    for name in (ENCODER[0], "no-such-model"):
        refused = client.post("/api/show", json={"model": name}, headers=elsewhere)
        assert (refused.status_code, refused.json()) == (
            404,
            {"error": f"model '{name}' not found"},
        )


def test_info_answers_the_default_model_only_to_a_key_that_may_use_it(
    client: TestClient,
) -> None:
    assert _ok(client.get("/info", headers=_auth("encoder")))["model"] == ENCODER[0]
    elsewhere = _auth("elsewhere")
    # TEI's /info is the default model's: a key that may not use it learns not even its name
    refused = client.get("/info", headers=elsewhere)
    assert refused.status_code == 404, refused.text
    assert refused.json()["error"]["code"] == "model_not_found"
    assert ENCODER[0] not in refused.text and ENCODER[1] not in refused.text
    assert _ok(client.get(f"/info?model={RERANKER}", headers=elsewhere))["model"] == RERANKER
    # a served model it may not use and an unknown name: the same words, no served name listed
    texts = {}
    for name in (ENCODER[1], "no-such-model"):
        answer = client.get(f"/info?model={name}", headers=elsewhere)
        assert answer.status_code == 404, name
        texts[name] = answer.json()["error"]["message"].replace(name, "NAME")
    assert texts[ENCODER[1]] == texts["no-such-model"]
    assert RERANKER not in texts["no-such-model"]
    # a key without `models` still gets the 404 that lists every served name
    listing = client.get("/info?model=no-such-model", headers=_auth("everything"))
    assert RERANKER in listing.json()["error"]["message"]


def test_every_listed_model_is_one_the_key_may_use(client: TestClient) -> None:
    for key in SEES:
        listed = _ok(client.get("/v1/models", headers=_auth(key)))["data"]
        for name in (card["id"] for card in listed):
            body = {"model": name, "input": "a"}
            answer = client.post("/v1/embeddings", json=body, headers=_auth(key))
            # the reranker embeds nothing (400): not a refusal of the key (403)
            assert answer.status_code == (400 if name == RERANKER else 200), (key, name)
