"""A model2vec model served through the real app: every embedding route, requests at once,
equals model2vec's StaticModel.encode."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np
import pytest

from tests.tiny_static import TEXTS, exact_model2vec, save_model2vec

# Against the exact mean, relative to the output's scale: the engine's float64 sums make each
# mean the exact one rounded to float32, 6e-8 off at worst (tests/models/test_static.py).
TOLERANCE = 1e-6
Read = Callable[[Any], list[list[float]]]
# route -> (body of the texts, normalize, the embeddings of its answer)
ROUTES: dict[str, tuple[Callable[[list[str], bool], dict[str, Any]], Read]] = {
    "/v1/embeddings": (
        lambda texts, norm: {"input": texts, "normalize": norm},
        lambda body: [item["embedding"] for item in body["data"]],
    ),
    "/v1/pooling": (
        lambda texts, norm: {"input": texts, "task": "embed", "normalize": norm},
        lambda body: [item["data"] for item in body["data"]],
    ),
    "/embed": (
        lambda texts, norm: {"inputs": texts, "normalize": norm},
        lambda body: body,
    ),
}


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Any, Any]]:
    from starlette.testclient import TestClient

    from poolserve.config.settings import ServerSettings
    from poolserve.http.app import create_app

    directory = save_model2vec(tmp_path_factory.mktemp("m2v"), normalize=True)
    settings = ServerSettings(model=str(directory), served_model_name="potion", max_num_seqs=3)
    with TestClient(create_app(settings)) as client:
        yield client, exact_model2vec(directory)


@pytest.mark.parametrize("normalize", [True, False])
def test_routes_at_once_equal_encode(served: tuple[Any, Any], normalize: bool) -> None:
    client, reference = served
    work = [(route, [text]) for route in ROUTES for text in TEXTS] + [
        (route, list(TEXTS)) for route in ROUTES
    ]

    def call(item: tuple[str, list[str]]) -> np.ndarray:
        route, texts = item
        body, read = ROUTES[route]
        response = client.post(route, json=body(texts, normalize))
        assert response.status_code == 200, (route, response.text)
        return np.asarray(read(response.json()), dtype=np.float32)

    with ThreadPoolExecutor(8) as pool:
        answers = list(pool.map(call, work))
    for (route, texts), got in zip(work, answers, strict=True):
        want = reference.encode(texts, normalize=normalize)
        assert got.shape == want.shape, route
        assert float(np.abs(got - want).max()) <= TOLERANCE * max(1.0, np.abs(want).max()), route


def test_info_names_the_static_model(served: tuple[Any, Any]) -> None:
    client, _ = served
    models = client.get("/v1/models").json()["data"]
    assert [m["id"] for m in models] == ["potion"]
    assert client.post("/v1/embeddings", json={"input": "hi", "model": "potion"}).status_code == 200


def test_other_tasks_are_refused(served: tuple[Any, Any]) -> None:
    client, _ = served
    # a classify request names what the static model serves instead
    response = client.post("/v1/pooling", json={"input": "hi", "task": "classify"})
    assert response.status_code == 400
    assert "embed" in response.json()["error"]["message"]
