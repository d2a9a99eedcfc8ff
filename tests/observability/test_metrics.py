"""/metrics parses with the Prometheus text parser and moves by the expected amounts."""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from prometheus_client import generate_latest, values
from prometheus_client.parser import text_string_to_metric_families

from poolserve.observability.metrics import GRPC, HTTP, ServiceMetrics, fix_process_identity
from poolserve.types.process import MULTIPROCESS_DIR


def _samples(client: Any) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    text = client.get("/metrics").text
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


# The families each request moves: their series also name its LoRA adapter ("" for none).
PER_REQUEST = (
    "poolserve_requests_total",
    "poolserve_request_duration_seconds",
    "poolserve_tokenization_duration_seconds",
    "poolserve_prompt_tokens_total",
    "poolserve_output_bytes_total",
)


# The families that also name the transport a request came by (the app's: HTTP).
BY_PROTOCOL = ("poolserve_requests_total", "poolserve_request_duration_seconds")


def _value(samples: dict[Any, float], name: str, **labels: str) -> float:
    """A sample of the model's (every series carries its served name, as vLLM's do)."""
    own = {"model_name": "llama", **({"lora_name": ""} if name.startswith(PER_REQUEST) else {})}
    if name.startswith(BY_PROTOCOL):
        own["protocol"] = "http"
    labels = {**own, **labels}
    return samples.get((name, tuple(sorted(labels.items()))), 0.0)


def test_counters_move_by_the_expected_amounts(make_client: Callable[..., Any]) -> None:
    with make_client("llama") as client:
        before = _samples(client)
        ids = [[5, 6, 7], [8, 9], [10, 11, 12, 13]]
        assert client.post("/v1/embeddings", json={"input": ids}).status_code == 200
        assert (
            client.post("/v1/pooling", json={"input": ids[:1], "task": "token_embed"}).status_code
            == 200
        )
        assert (
            client.post("/v1/pooling", json={"input": "a", "task": "classify"}).status_code == 400
        )
        after = _samples(client)

    def delta(name: str, **labels: str) -> float:
        return _value(after, name, **labels) - _value(before, name, **labels)

    assert (
        delta("poolserve_requests_total", endpoint="/v1/embeddings", task="embed", status="200")
        == 1
    )
    assert (
        delta("poolserve_requests_total", endpoint="/v1/pooling", task="token_embed", status="200")
        == 1
    )
    assert (
        delta("poolserve_requests_total", endpoint="/v1/pooling", task="classify", status="400")
        == 1
    )
    assert delta("poolserve_prompt_tokens_total") == 9 + 3
    assert delta("poolserve_queue_duration_seconds_count") == 4
    assert delta("poolserve_inference_duration_seconds_count") == 4
    assert delta("poolserve_step_tokens_total") == 12
    assert delta("poolserve_tokenization_duration_seconds_count") == 2
    assert delta("poolserve_request_duration_seconds_count", endpoint="/v1/embeddings") == 1
    assert delta("poolserve_output_bytes_total") > 0
    assert _value(after, "poolserve_ready") == 1
    assert _value(after, "poolserve_kv_blocks_used") == 0
    assert _value(after, "poolserve_kv_blocks_capacity") > 0
    assert _value(after, "poolserve_waiting_requests") == 0


def test_labels_never_take_client_values(make_client: Callable[..., Any]) -> None:
    with make_client("llama") as client:
        client.post("/v1/nonexistent-route-xyz", json={})
        client.post("/v1/pooling", json={"input": "a", "task": "client-made-up"})
        client.post("/v1/embeddings", json={"input": "a", "model": "client-made-model"})
        text = client.get("/metrics").text
    assert "nonexistent-route-xyz" not in text and "client-made-up" not in text
    assert "client-made-model" not in text  # an unknown name is no model: model_name=""


def test_a_fixed_process_identity_names_the_files_and_sums(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The values read the pid once, not per inc; a scrape still sums what they wrote."""
    monkeypatch.setenv(MULTIPROCESS_DIR, str(tmp_path))
    monkeypatch.setattr(values, "ValueClass", values.ValueClass)  # restored after the test
    identifiers: list[Callable[[], int]] = []
    real = values.MultiProcessValue

    def spy(process_identifier: Callable[[], int] = os.getpid) -> Any:
        identifiers.append(process_identifier)
        return real(process_identifier)

    monkeypatch.setattr(values, "MultiProcessValue", spy)
    fix_process_identity()
    (identifier,) = identifiers
    assert identifier is not os.getpid and identifier() == os.getpid()
    metrics = ServiceMetrics()
    model = metrics.model("m")
    for _ in range(3):
        model.on_request_done(0.002, 0.02)
        model.prompt_tokens.inc(7)
    files = list(tmp_path.iterdir())
    assert files and all(p.name.endswith(f"_{os.getpid()}.db") for p in files)
    families = {f.name: f for f in text_string_to_metric_families(metrics.render().decode())}
    tokens = families["poolserve_prompt_tokens"].samples
    assert [s.value for s in tokens if s.name.endswith("_total")] == [21.0]
    queue = families["poolserve_queue_duration_seconds"].samples
    assert [s.value for s in queue if s.name.endswith("_count")] == [3.0]


def test_each_transport_counts_under_its_protocol_with_children_made_once(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    metrics = ServiceMetrics()
    looked_up: list[tuple[str, ...]] = []
    for family in (metrics.requests, metrics.request_duration):
        real = family.labels

        def spy(*values: str, real: Callable[..., Any] = real) -> Any:
            looked_up.append(values)
            return real(*values)

        monkeypatch.setattr(family, "labels", spy)
    for _ in range(3):
        metrics.transports[HTTP].add("m", "", "/embed", "embed", 200, 0.01)
    metrics.transports[GRPC].add("m", "", "/tei.v1.Embed/Embed", "embed", 200, 0.02)
    # a label set's two children are made on its first request, never again
    assert looked_up == [
        ("m", "", "http", "/embed", "embed", "200"),
        ("m", "", "http", "/embed"),
        ("m", "", "grpc", "/tei.v1.Embed/Embed", "embed", "200"),
        ("m", "", "grpc", "/tei.v1.Embed/Embed"),
    ]
    text = generate_latest(metrics.registry).decode()
    families = {f.name: f for f in text_string_to_metric_families(text)}
    requests = {
        (s.labels["protocol"], s.labels["endpoint"]): s.value
        for s in families["poolserve_requests"].samples
        if s.name.endswith("_total")
    }
    assert requests == {("http", "/embed"): 3.0, ("grpc", "/tei.v1.Embed/Embed"): 1.0}
    durations = {
        s.labels["protocol"]: s.value
        for s in families["poolserve_request_duration_seconds"].samples
        if s.name.endswith("_count")
    }
    assert durations == {"http": 3.0, "grpc": 1.0}
