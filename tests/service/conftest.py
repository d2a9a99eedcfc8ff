"""App clients over tiny checkpoints, and Hugging Face references for their outputs."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import pytest
import torch
from starlette.testclient import TestClient

from poolserve.service.app import create_app
from poolserve.service.settings import ServerSettings
from tests.tiny_models import build_hf_model

ClientFactory = Callable[..., "contextmanager[TestClient]"]


@pytest.fixture(scope="session")
def make_client(tiny_model_dir: Callable[[str], Path]) -> Callable[..., object]:
    """make_client(name or None, **settings) -> context manager yielding a started TestClient."""

    @contextmanager
    def make(name: str | None, **settings: object) -> Iterator[TestClient]:
        model = str(tiny_model_dir(name)) if name else None
        app = create_app(
            ServerSettings(model=model, served_model_name=name or "minilm", **settings)
        )
        with TestClient(app) as client:
            yield client

    return make


def hf_hidden(name: str, ids: list[int]) -> torch.Tensor:
    """Last hidden states of the Hugging Face backbone for one prompt."""
    model = build_hf_model(name)
    with torch.inference_mode():
        out = model.base_model(input_ids=torch.tensor([ids]))
    return out.last_hidden_state[0].float()  # [num_tokens, hidden]


def hf_logits(name: str, ids: list[int]) -> torch.Tensor:
    """Logits of the Hugging Face model with its own head for one prompt."""
    model = build_hf_model(name)
    with torch.inference_mode():
        return model(input_ids=torch.tensor([ids])).logits[0].float()


def assert_close(got: object, want: torch.Tensor | np.ndarray) -> None:
    """float32 tolerance relative to the reference's scale."""
    ref = want.numpy() if isinstance(want, torch.Tensor) else want
    arr = np.asarray(got, dtype=np.float32)
    assert arr.shape == ref.shape, (arr.shape, ref.shape)
    scale = max(float(np.abs(ref).max()), 1e-6)
    assert float(np.abs(arr - ref).max()) <= 1e-4 * scale
