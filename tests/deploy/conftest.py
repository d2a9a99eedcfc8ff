"""Fixtures of the deployment tests."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.deploy.tools import StubServer, running_stub


@pytest.fixture
def http_stub() -> Iterator[StubServer]:
    """A loopback HTTP server whose per-path status the test sets."""
    with running_stub() as server:
        yield server
