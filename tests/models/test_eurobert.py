"""EuroBERT's base model: Llama's layers attending both ways, equal to transformers, served."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
import transformers
from starlette.testclient import TestClient
from transformers import AutoTokenizer

from poolserve.config.settings import ServerSettings
from poolserve.http.app import create_app
from poolserve.models import load_model
from tests.models.driver import assert_close, make_prompts
from tests.models.test_encoder_families import run_packed
from tests.models.test_gte import write_st_pooling
from tests.tiny_decoders import _decoder, _perturb
from tests.tiny_models import write_tokenizer

CPU = torch.device("cpu")
# Grouped queries, a low theta so positions matter over the 300-token prompt; MiniLM's ids.
EUROBERT = _decoder(
    rope_parameters={"rope_type": "default", "rope_theta": 1000.0},
    bos_token_id=101,
    eos_token_id=102,
    mask_token_id=103,
)


def build_eurobert(seed: int = 0) -> Any:
    torch.manual_seed(seed)
    config = transformers.EuroBertConfig(**EUROBERT)
    config._attn_implementation = "eager"
    model = transformers.EuroBertModel(config)
    _perturb(model, seed)
    return model.eval()


@pytest.fixture(scope="module")
def reference() -> Any:
    return build_eurobert()


@pytest.fixture(scope="module")
def directory(tmp_path_factory: pytest.TempPathFactory, reference: Any) -> Path:
    path = tmp_path_factory.mktemp("eurobert")
    reference.save_pretrained(path)
    write_tokenizer(path)
    return path


def _hidden(model: Any, prompt: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=torch.tensor([prompt])).last_hidden_state[0]


def test_packed_batch_equals_hf_bidirectionally(directory: Path, reference: Any) -> None:
    model = load_model(str(directory), device=CPU)
    assert model.spec.architecture == "EuroBertModel" and model.spec.family == "eurobert"
    # scheduled like an encoder: whole prompts, no chunking, no prefix cache
    assert not model.spec.is_causal
    prompts = make_prompts((1, 5, 37, 130, 300), seed=2)
    for prompt, hidden in zip(prompts, run_packed(model, prompts), strict=True):
        assert_close(hidden, _hidden(reference, prompt))
    # a later token changes an earlier one's state: attention runs both ways
    first, longer = run_packed(model, [prompts[2][:10], prompts[2][:11]])
    assert not torch.allclose(first[0], longer[0])


def test_embeddings_route_mean_pools_as_the_st_config_says(tmp_path: Path, reference: Any) -> None:
    reference.save_pretrained(tmp_path)
    write_tokenizer(tmp_path)
    write_st_pooling(tmp_path, "mean")
    assert json.loads((tmp_path / "config.json").read_text())["model_type"] == "eurobert"
    texts = ["hello world", "x", "a longer sentence about european languages " * 10]
    settings = ServerSettings(model=str(tmp_path), served_model_name="eurobert")
    with TestClient(create_app(settings)) as client:
        response = client.post("/v1/embeddings", json={"input": texts, "model": "eurobert"})
    assert response.status_code == 200, response.text
    tokenizer = AutoTokenizer.from_pretrained(str(tmp_path))
    for text, item in zip(texts, response.json()["data"], strict=True):
        pooled = _hidden(reference, tokenizer(text)["input_ids"]).mean(dim=0)
        want = torch.nn.functional.normalize(pooled, dim=-1)
        assert_close(torch.tensor(item["embedding"]), want)
