"""Fixtures of the tests that serve a model: app clients, the live MiniLM server and the live
servers of the vLLM ports.

Registered once for the whole suite by tests/conftest.py (`pytest_plugins`), so tests/http,
tests/frontend, tests/config and tests/observability share one instance of each session fixture:
one live server per run and configuration, whichever folders run. tests/conftest.py loads this
module in every run, scripts/gpu_check.sh's too, where the HTTP service is not installed: it
imports nothing of the service until a fixture is used (the helpers are in
tests/http/serving.py).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

if TYPE_CHECKING:
    import httpx

    from tests.http.serving import LiveServers


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


@pytest.fixture(scope="session")
def live_servers() -> Iterator[LiveServers]:
    """Real `poolserve serve` processes, one per distinct served configuration, shared by the
    whole run (the vLLM ports run against them, as vLLM's own tests run against
    `RemoteOpenAIServer`); SIGTERM to each at the end of the session."""
    from tests.http.serving import LiveServers

    servers = LiveServers()
    try:
        yield servers
    finally:
        servers.close()
