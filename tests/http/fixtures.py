"""Fixtures of the tests that serve a model: app clients and the live MiniLM server.

Registered once for the whole suite by tests/conftest.py (`pytest_plugins`), so tests/http,
tests/frontend, tests/config and tests/observability share one instance of each session fixture:
one live server per run, whichever folders run. tests/conftest.py loads this module in every
run, scripts/gpu_check.sh's too, where the HTTP service is not installed: it imports nothing of
the service until a fixture is used (the helpers are in tests/http/serving.py).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

if TYPE_CHECKING:
    import httpx


@pytest.fixture(scope="session")
def make_client(tiny_model_dir: Callable[[str], Path]) -> Callable[..., object]:
    """make_client(name or None, **settings) -> context manager yielding a started TestClient."""
    from tests.http.serving import started_client

    return partial(started_client, tiny_model_dir)


@pytest.fixture(scope="session")
def live_minilm() -> Iterator[httpx.Client]:
    """A real `poolserve serve` process (uvicorn) on the bundled MiniLM, and a client for it.

    The conformance modules replay each upstream's examples through it as well as through the
    in-process app: the same answers over a real socket, HTTP parser and server.
    """
    from tests.http.serving import LIVE_NAMES, live_server

    with live_server("--served-model-name", *LIVE_NAMES) as client:
        yield client
