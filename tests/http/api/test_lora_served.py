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


def test_sagemaker_adapter_header_names_the_adapter(
    served: tuple[TestClient, dict, dict],
) -> None:
    """SageMaker's X-Amzn-SageMaker-Adapter-Identifier (AWS's container standards, which vLLM's
    /invocations applies) replaces the body's `model`: the adapter answers, as it does when the
    body names it; an adapter not loaded is a 404."""
    client, _, _ = served
    body = {"model": BASE, "input": TEXT}
    direct = client.post("/v1/embeddings", json={**body, "model": "legal"})
    header = {"X-Amzn-SageMaker-Adapter-Identifier": "legal"}
    invoked = client.post("/invocations", json=body, headers=header)
    assert invoked.status_code == 200, invoked.text
    assert invoked.json()["model"] == "legal"
    assert invoked.json()["data"] == direct.json()["data"]
    header = {"X-Amzn-SageMaker-Adapter-Identifier": "finance"}
    missing = client.post("/invocations", json=body, headers=header)
    assert missing.status_code == 404
    assert missing.json()["error"]["param"] == "model"


def test_adapters_load_and_unload_at_run_time(
    served: tuple[TestClient, dict, dict], tmp_path: Path
) -> None:
    """vLLM's routes and answers: a loaded adapter is listed and answers as PEFT does (a third
    adapter on two slots: the least recently used one makes room); loading a name twice is a
    400, an unload of a name not loaded a 404, and an unloaded adapter is gone."""
    client, references, _ = served
    base = references[BASE]
    finance = _random_adapter(base, LoraConfig(r=8, target_modules=["query", "value"]), 7)
    finance.save_pretrained(tmp_path / "finance")
    load = {"lora_name": "finance", "lora_path": str(tmp_path / "finance")}
    loaded = client.post("/v1/load_lora_adapter", json=load)
    assert loaded.status_code == 200, loaded.text
    assert loaded.text == "Success: LoRA adapter 'finance' added successfully."
    cards = {card["id"]: card for card in client.get("/v1/models").json()["data"]}
    assert cards["finance"]["parent"] == BASE
    tokens = client.post("/tokenize", json={"prompt": TEXT}).json()["tokens"]
    for name in ("finance", "legal", "medical", "finance"):  # two slots, three adapters
        body = {"model": name, "input": TEXT, "task": "token_embed", "normalize": False}
        pooled = client.post("/v1/pooling", json=body)
        assert pooled.status_code == 200, pooled.text
        got = np.asarray(pooled.json()["data"][0]["data"], dtype=np.float32)
        reference = finance if name == "finance" else references[name]
        want = _states(reference, tokens)
        assert float(np.abs(got - want).max()) <= TOLERANCE * max(1.0, float(np.abs(want).max()))

    again = client.post("/v1/load_lora_adapter", json=load)
    assert again.status_code == 400
    assert again.json()["error"]["message"] == "The lora adapter 'finance' has already been loaded."

    removed = client.post("/v1/unload_lora_adapter", json={"lora_name": "finance"})
    assert removed.status_code == 200, removed.text
    assert removed.text == "Success: LoRA adapter 'finance' removed successfully."
    gone = client.post("/v1/embeddings", json={"model": "finance", "input": TEXT})
    assert gone.status_code == 404
    twice = client.post("/v1/unload_lora_adapter", json={"lora_name": "finance"})
    assert twice.status_code == 404
    assert twice.json()["error"]["message"] == "The lora adapter 'finance' cannot be found."


def test_an_adapter_that_does_not_fit_is_a_400_naming_why(
    served: tuple[TestClient, dict, dict], tmp_path: Path
) -> None:
    """Rank above --max-lora-rank, a module the model lacks, no folder: each a 400 with its
    reason, and the adapter is not served."""
    client, references, _ = served
    wide = _random_adapter(references[BASE], LoraConfig(r=32, target_modules=["query"]), 3)
    wide.save_pretrained(tmp_path / "wide")
    pooler = _random_adapter(references[BASE], LoraConfig(r=2, target_modules=["pooler.dense"]), 4)
    pooler.save_pretrained(tmp_path / "pooler")
    cases = {
        "wide": ("above --max-lora-rank 16", tmp_path / "wide"),
        "pooler": ("is not one of the model's layer projections", tmp_path / "pooler"),
        "nowhere": ("no such folder", tmp_path / "nowhere"),
    }
    for name, (words, folder) in cases.items():
        response = client.post(
            "/v1/load_lora_adapter", json={"lora_name": name, "lora_path": str(folder)}
        )
        assert response.status_code == 400, response.text
        assert words in response.json()["error"]["message"], response.text
        assert client.post("/v1/embeddings", json={"model": name, "input": TEXT}).status_code == 404


def test_an_adapters_requests_are_observed_under_its_base(
    served: tuple[TestClient, dict, dict], tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """As vLLM counts them, an adapter's requests count under its base model: /metrics has them
    under the base's model_name with the adapter's lora_name, and per model the adapters loaded,
    resident and evicted and vLLM's lora_requests_info; the access log line and the request span
    name the base as the model and the adapter as lora_name (nothing of it on the base's own)."""
    import logging

    from prometheus_client.parser import text_string_to_metric_families

    from poolserve.observability.logs import ACCESS_LOGGER, FIELDS_ATTR
    from tests.frontend.test_one_pipeline import Recorder

    client, references, _ = served

    def scrape() -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
        text = client.get("/metrics").text
        return {
            (s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text)
            for s in family.samples
        }

    def lines(request_id: str) -> list[logging.LogRecord]:
        return [
            r
            for r in caplog.records
            if r.name == ACCESS_LOGGER and getattr(r, FIELDS_ATTR)["request_id"] == request_id
        ]

    # a third adapter on two slots: one of the three is evicted as the others take its slot
    extra = _random_adapter(references[BASE], LoraConfig(r=2, target_modules=["query"]), 11)
    extra.save_pretrained(tmp_path / "extra")
    load = {"lora_name": "extra", "lora_path": str(tmp_path / "extra")}
    assert client.post("/v1/load_lora_adapter", json=load).status_code == 200
    before = scrape()
    state = client.app.state.poolserve  # type: ignore[attr-defined]
    tracing, state.tracing = state.tracing, Recorder()
    try:
        with caplog.at_level(logging.INFO, ACCESS_LOGGER):
            for name in ("extra", "legal", "medical", BASE):
                body = {"model": name, "input": TEXT}
                sent = client.post("/v1/embeddings", json=body, headers={"x-request-id": name})
                assert sent.status_code == 200, sent.text
                assert sent.json()["model"] == name  # answers still name the adapter
        spans = [t.attributes for t in state.tracing.traces]
    finally:
        state.tracing = tracing
    after = scrape()

    def grew(name: str, **labels: str) -> float:
        key = (name, tuple(sorted({"model_name": BASE, **labels}.items())))
        return after.get(key, 0.0) - before.get(key, 0.0)

    route = {"protocol": "http", "endpoint": "/v1/embeddings", "task": "embed", "status": "200"}
    for lora in ("extra", "legal", "medical", ""):  # "": the base model's own requests
        assert grew("poolserve_requests_total", lora_name=lora, **route) == 1, lora
        assert grew("poolserve_prompt_tokens_total", lora_name=lora) > 0, lora
        assert grew("poolserve_tokenization_duration_seconds_count", lora_name=lora) == 1, lora
        assert grew("poolserve_output_bytes_total", lora_name=lora) > 0, lora
    models = {dict(labels)["model_name"] for _, labels in after}
    assert models.isdisjoint(CONFIGS) and "extra" not in models  # no adapter counts as a model

    assert after[("poolserve_lora_adapters_loaded", (("model_name", BASE),))] == 3
    assert after[("poolserve_lora_adapters_resident", (("model_name", BASE),))] == 2
    assert grew("poolserve_lora_adapter_evictions_total") >= 1
    info = [(labels, v) for (n, labels), v in after.items() if n == "poolserve_lora_requests_info"]
    ((labels, value),) = info
    assert dict(labels) == {
        "model_name": BASE,
        "max_lora": "2",
        "running_lora_adapters": "",  # nothing in flight while /metrics answers
        "waiting_lora_adapters": "",
    }
    assert value > 1e9  # vLLM's value: the Unix time it was read

    for name in ("extra", "legal", "medical"):
        (line,) = lines(name)
        fields = getattr(line, FIELDS_ATTR)
        assert (fields["model"], fields["lora_name"]) == (BASE, name)
        assert f" model={BASE} lora_name={name} prompt_tokens=" in line.getMessage()
    (own,) = lines(BASE)
    assert "lora_name" not in getattr(own, FIELDS_ATTR)
    assert "lora_name" not in own.getMessage()
    assert [span["poolserve.model"] for span in spans] == [BASE] * 4
    adapters = [span.get("poolserve.lora_name") for span in spans]
    assert adapters == ["extra", "legal", "medical", None]

    assert client.post("/v1/unload_lora_adapter", json={"lora_name": "extra"}).status_code == 200
    unloaded = scrape()
    assert unloaded[("poolserve_lora_adapters_loaded", (("model_name", BASE),))] == 2


@pytest.mark.parametrize(
    "body",
    [
        b'{"lora_name": "\\ud800", "lora_path": "/adapters/a"}',  # a lone surrogate
        b'{"lora_name": "a", "lora_path": "\\udfff"}',
        b'{"lora_name": "' + b"a" * 257 + b'", "lora_path": "/adapters/a"}',
        b'{"lora_name": "a", "lora_path": "' + b"p" * 4097 + b'"}',
    ],
)
def test_hostile_load_bodies_are_400s(served: tuple[TestClient, dict, dict], body: bytes) -> None:
    """Names and paths travel to the engine core and every front end: bounded and valid UTF-8
    before any work, never a 500."""
    client, _, _ = served
    headers = {"content-type": "application/json"}
    response = client.post("/v1/load_lora_adapter", content=body, headers=headers)
    assert response.status_code == 400, response.text
    cards = client.get("/v1/models").json()["data"]
    assert len(cards) == 3  # the base and its two adapters, nothing added
