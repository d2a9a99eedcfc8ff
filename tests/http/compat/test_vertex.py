"""Vertex AI, as TEI serves it: `{"instances": [...]}` on `/vertex` (and on AIP_PREDICT_ROUTE),
each instance answered by its TEI route (a rerank body as rerank, else the model's main task),
`{"predictions": [...]}` in instance order; the health route Vertex names answers as /ready
without the key; the port Vertex names is the server's. Each prediction equals the TEI route's
own answer to the same body."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
from starlette.testclient import TestClient

from poolserve.config.settings import ServerSettings

QUERY = "what is the capital of france"
TEXTS = ["paris is the capital of france", "the cat sat on the mat"]


def _predictions(client: TestClient, path: str, instances: list[Any]) -> list[Any]:
    answer = client.post(path, json={"instances": instances})
    assert answer.status_code == 200, answer.text
    document = answer.json()
    assert list(document) == ["predictions"]
    predictions: list[Any] = document["predictions"]
    return predictions


def test_instances_are_answered_by_their_tei_route(make_client: Callable[..., Any]) -> None:
    with make_client(None) as client:
        instances = [{"inputs": "a text"}, {"inputs": TEXTS, "normalize": False}]
        instances.append({"query": QUERY, "texts": TEXTS, "return_text": True})
        predicted = _predictions(client, "/vertex", instances)
        # the instances may share an engine step: equal to the batching tolerance
        for got, one in zip(predicted[:2], instances[:2], strict=True):
            alone = client.post("/embed", json=one).json()
            assert np.allclose(np.array(got), np.array(alone), rtol=0, atol=1e-6)
        ranked = client.post("/rerank", json=instances[2]).json()
        assert [(r["index"], r["text"]) for r in predicted[2]] == [
            (r["index"], r["text"]) for r in ranked
        ]
        got_scores = [r["score"] for r in predicted[2]]
        assert got_scores == pytest.approx([r["score"] for r in ranked], abs=1e-6)


def test_a_classifier_answers_predict(make_client: Callable[..., Any]) -> None:
    with make_client("llama_cls3") as client:
        instances = [{"inputs": "good"}, {"inputs": ["bad", "fine"]}]
        predicted = _predictions(client, "/vertex", instances)
        for got, one in zip(predicted, instances, strict=True):
            alone = client.post("/predict", json=one).json()
            assert str(got).count("label") == str(alone).count("label") > 0
            assert _scores(got) == pytest.approx(_scores(alone), abs=1e-6)


def _scores(prediction: Any) -> list[float]:
    """Every score of a /predict answer (one input's list, or a list of them), in order."""
    if isinstance(prediction, dict):
        return [float(prediction["score"])]
    return [score for item in prediction for score in _scores(item)]


def test_errors_answer_in_tei_shape(make_client: Callable[..., Any]) -> None:
    with make_client(None, max_client_batch_size=2) as client:
        for body in ({"instances": []}, {"instances": "text"}, {"instances": [1]}):
            refused = client.post("/vertex", json=body)
            assert refused.status_code in (400, 422), refused.text
            assert set(refused.json()) == {"error", "error_type"}, refused.text
        many = client.post("/vertex", json={"instances": [{"inputs": "a"}] * 3})
        # as TEI's own routes answer a batch over the limit
        over = client.post("/embed", json={"inputs": ["a"] * 3})
        assert many.status_code == over.status_code and over.status_code >= 400
        assert "instances has 3 items, more than the limit of 2" in many.json()["error"]
        bad_instance = client.post("/vertex", json={"instances": [{"inputs": "a"}, {"x": 1}]})
        assert bad_instance.status_code in (400, 422)
        assert set(bad_instance.json()) == {"error", "error_type"}


def test_the_routes_and_port_vertex_names(
    make_client: Callable[..., Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("AIP_HTTP_PORT", "8080")
    monkeypatch.setenv("AIP_PREDICT_ROUTE", "/v1/endpoints/e1/deployedModels/m1:predict")
    monkeypatch.setenv("AIP_HEALTH_ROUTE", "/v1/endpoints/e1/deployedModels/m1")
    settings = ServerSettings()
    assert settings.port == 8080
    predict, health = settings.vertex_predict_route, settings.vertex_health_route
    assert health is not None
    with make_client(None, api_key="secret") as client:
        assert client.get(health).status_code == 200  # open: Vertex sends no key
        key = {"Authorization": "Bearer secret"}
        assert client.post(predict, json={"instances": [{"inputs": "a"}]}).status_code == 401
        answer = client.post(predict, json={"instances": [{"inputs": "a"}]}, headers=key)
        assert answer.status_code == 200, answer.text
        assert len(answer.json()["predictions"][0][0]) == 384
