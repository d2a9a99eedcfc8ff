"""Every model family served end to end over HTTP with its natural task, equal to transformers."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from starlette.testclient import TestClient

from poolserve.config.settings import ServerSettings
from poolserve.http.app import create_app
from tests.http.serving import assert_close
from tests.tiny_decoders import build_hf_decoder, decoder_dirs
from tests.tiny_encoders import build_hf_encoder, encoder_dirs

TEXTS = ["hello world", "a longer sentence about families and their natural tasks " * 5, "x"]
# (fixture set, fixture name, task): one row per family the model-coverage work added.
CASES = [
    ("decoder", "gemma", "embed"),
    ("decoder", "gemma_cls", "classify"),
    ("decoder", "gemma3_cls", "classify"),
    ("decoder", "phi3_tokcls", "token_classify"),
    ("decoder", "granite_base", "embed"),
    ("decoder", "qwen2_bidir", "embed"),
    ("encoder", "distilbert_cls", "classify"),
    ("encoder", "roberta_tokcls", "token_classify"),
    ("encoder", "xlmroberta", "embed"),
    ("encoder", "camembert_tokcls", "token_classify"),
    ("encoder", "mpnet", "embed"),
    ("encoder", "nomicbert_cls", "classify"),
]
BUILDERS: dict[str, Callable[[str], Any]] = {
    "decoder": build_hf_decoder,
    "encoder": build_hf_encoder,
}


@pytest.fixture(scope="module")
def directories(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Callable[[str], Path]]:
    """Fixture set -> (name -> directory of that tiny checkpoint)."""
    return {"decoder": decoder_dirs(tmp_path_factory), "encoder": encoder_dirs(tmp_path_factory)}


def _reference(kind: str, name: str, task: str, ids: list[int]) -> torch.Tensor:
    """What transformers computes for one prompt and task."""
    model = BUILDERS[kind](name)
    with torch.no_grad():
        if task != "embed":
            return model(input_ids=torch.tensor([ids])).logits[0].float()
        hidden = model.base_model(input_ids=torch.tensor([ids])).last_hidden_state[0].float()
    row = hidden[-1] if kind == "decoder" else hidden[0]  # decoders LAST, encoders CLS
    return F.normalize(row, dim=-1)


@pytest.mark.parametrize(("kind", "name", "task"), CASES)
def test_family_served_equals_transformers(
    directories: dict[str, Callable[[str], Path]], kind: str, name: str, task: str
) -> None:
    settings = ServerSettings(model=str(directories[kind](name)), served_model_name=name)
    with TestClient(create_app(settings)) as client:
        ids = [client.post("/tokenize", json={"prompt": t}).json()["tokens"] for t in TEXTS]
        body: dict[str, object] = {"input": TEXTS, "task": task}
        body.update({"normalize": True} if task == "embed" else {"use_activation": False})
        response = client.post("/v1/pooling", json=body)
    assert response.status_code == 200, response.text
    for prompt, item in zip(ids, response.json()["data"], strict=True):
        assert_close(item["data"], _reference(kind, name, task, prompt))
