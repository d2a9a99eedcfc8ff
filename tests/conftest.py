"""Shared fixtures: tiny checkpoints saved once per session."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from tests.tiny_models import minilm_path, save_tiny_model

# The served-model fixtures (app clients, the live MiniLM server), one instance for every folder;
# pytest reads `pytest_plugins` only here, in the root conftest.
pytest_plugins = ("tests.http.fixtures",)
# Assertions of the served-model helpers report their values as a conftest's would.
pytest.register_assert_rewrite("tests.http.serving")

torch.manual_seed(0)


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], Path]:
    """Returns a function name -> directory of that tiny checkpoint, built on first use."""
    built: dict[str, Path] = {}

    def get(name: str) -> Path:
        if name not in built:
            built[name] = save_tiny_model(name, tmp_path_factory.mktemp(name))
        return built[name]

    return get


@pytest.fixture(scope="session")
def minilm_dir() -> Path:
    """The real all-MiniLM-L6-v2 checkpoint shipped inside site-packages."""
    return minilm_path()
