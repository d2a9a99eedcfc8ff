"""The embedded model answers to its Hub id: no network, the same directory as `--model` none."""

from __future__ import annotations

import pytest

from poolserve.config.model_path import resolve_model_path
from poolserve.types.errors import ModelLoadError
from poolserve.types.model import DEFAULT_MODEL_ID


def test_the_hub_id_of_the_embedded_model_is_the_embedded_copy(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    assert resolve_model_path(DEFAULT_MODEL_ID) == resolve_model_path(None)


def test_a_revision_of_it_still_asks_the_hub(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(ModelLoadError, match="HF_HUB_OFFLINE is set"):
        resolve_model_path(DEFAULT_MODEL_ID, revision="0123456789abcdef")
