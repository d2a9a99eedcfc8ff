"""Direct routes: the body-only JSON POSTs answered before Starlette's routing answer exactly as
the app's own FastAPI handlers do, and skip the router."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from starlette.testclient import TestClient

from poolserve.config.settings import ServerSettings
from poolserve.http.app import create_app
from poolserve.http.routing import DirectRoutes

JSON = {"content-type": "application/json"}
# (path, raw body, headers): answers, every kind of refusal, and TEI's error family
REQUESTS = [
    ("/v1/embeddings", b'{"input": ["a b c", "d e"]}', JSON),
    ("/v1/embeddings", b'{"input": "a", "encoding_format": "base64"}', JSON),
    ("/v1/embeddings", b'{"input": "a", "dimensions": "x"}', JSON),
    ("/v1/embeddings", b'{"input": "a", "input": "b"}', JSON),
    ("/v1/embeddings", b'{"input": "a",', JSON),
    ("/v1/embeddings", b'{"input": "\xff"}', JSON),
    ("/v1/embeddings", b'{"input": NaN}', JSON),
    ("/v1/embeddings", b"[1, 2]", JSON),
    ("/v1/embeddings", b"", JSON),
    ("/v1/embeddings", b'{"input": "a", "model": "nobody"}', JSON),
    ("/v1/embeddings", b'{"input": "a"}', {"content-type": "application/json; charset=utf-8"}),
    ("/v1/embeddings", b'{"input": "a"}', {"content-type": "text/plain"}),
    ("/v1/embeddings", b"[" * 100_000 + b"]" * 100_000, JSON),
    ("/v1/pooling", b'{"input": "a b", "task": "token_embed"}', JSON),
    ("/v1/pooling", b'{"input": "a b", "task": "nothing"}', JSON),
    ("/embed", b'{"inputs": ["a b", "c"]}', JSON),
    ("/embed", b'{"inputs": 3}', JSON),
    ("/embed", b'{"inputs": "a",', JSON),
    ("/embed", b'{"inputs": ""}', JSON),
    ("/v2/embed", b'{"texts": ["a"], "input_type": "search_query"}', JSON),
    ("/tokenize", b'{"prompt": "a b"}', JSON),
]
VOLATILE = ("id", "created")  # a fresh id and clock per answer


@pytest.fixture(scope="module")
def clients(tiny_model_dir: Callable[[str], Path]) -> Iterator[tuple[TestClient, TestClient]]:
    """The app as served, and the same app with its direct routes taken out."""
    with (
        _client(tiny_model_dir, direct=True) as direct,
        _client(tiny_model_dir, direct=False) as app,
    ):
        yield direct, app


@contextmanager
def _client(tiny_model_dir: Callable[[str], Path], *, direct: bool) -> Iterator[TestClient]:
    settings = ServerSettings(model=str(tiny_model_dir("bert")), served_model_name="bert")
    app = create_app(settings, owns_process=False)
    if not direct:
        app.user_middleware = [m for m in app.user_middleware if m.cls is not DirectRoutes]
    with TestClient(app) as client:
        yield client


def _document(response: Any) -> Any:
    if not response.headers.get("content-type", "").startswith("application/json"):
        return response.content
    document = response.json()
    if isinstance(document, dict):
        return {k: v for k, v in document.items() if k not in VOLATILE}
    return document


@pytest.mark.parametrize(("path", "body", "headers"), REQUESTS)
def test_direct_answers_equal_the_apps(
    clients: tuple[TestClient, TestClient], path: str, body: bytes, headers: dict[str, str]
) -> None:
    direct, app = clients
    got = direct.post(path, content=body, headers=headers)
    want = app.post(path, content=body, headers=headers)
    assert got.status_code == want.status_code, (got.text, want.text)
    left, right = _document(got), _document(want)
    if got.status_code == 200 and path == "/v1/embeddings" and b"base64" not in body:
        vectors = [np.asarray([d["embedding"] for d in doc["data"]]) for doc in (left, right)]
        np.testing.assert_allclose(vectors[0], vectors[1], rtol=1e-5, atol=1e-6)
        left, right = left["usage"], right["usage"]
    assert left == right
    names = ("content-type", "retry-after", "connection")
    assert {k: got.headers.get(k) for k in names} == {k: want.headers.get(k) for k in names}


class CountingRouter:
    """An ASGI wrapper counting what reaches the app's router."""

    def __init__(self, app: Any) -> None:
        self.app, self.calls = app, 0

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        self.calls += scope["type"] == "http"
        await self.app(scope, receive, send)


def test_body_only_posts_skip_the_router(tiny_model_dir: Callable[[str], Path]) -> None:
    settings = ServerSettings(model=str(tiny_model_dir("bert")), served_model_name="bert")
    app = create_app(settings)
    counting = CountingRouter(app.router)
    app.router = counting  # type: ignore[assignment]
    with TestClient(app) as client:
        for path, body in (("/v1/embeddings", {"input": "a"}), ("/embed", {"inputs": "a"})):
            assert client.post(path, json=body).status_code == 200
        assert counting.calls == 0
        # another content type, a bad body, a GET: the app's own routing
        assert client.post("/v1/embeddings", content=b"a", headers={}).status_code == 400
        assert client.post("/v1/embeddings", content=b"{", headers=JSON).status_code == 400
        assert client.get("/v1/models").status_code == 200
        assert counting.calls == 3


def test_root_path_prefix_is_direct_too(tiny_model_dir: Callable[[str], Path]) -> None:
    settings = ServerSettings(
        model=str(tiny_model_dir("bert")), served_model_name="bert", root_path="/api"
    )
    app = create_app(settings)
    counting = CountingRouter(app.router)
    app.router = counting  # type: ignore[assignment]
    with TestClient(app) as client:
        for path in ("/api/v1/embeddings", "/v1/embeddings"):
            response = client.post(path, json={"input": "a"})
            assert response.status_code == 200, response.text
        assert counting.calls == 0
