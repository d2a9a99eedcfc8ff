"""vLLM's logit_mean / logit_sigma: `activation((logit - logit_mean) / logit_sigma)`.

Set in --pooler-config, applied by the engine core's classifier heads to the raw logits before
the activation: classify, token_classify, and a cross-encoder's score and rerank. The reference
is transformers' own logits, transformed and activated here.
"""

from __future__ import annotations

import asyncio
import json
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from starlette.testclient import TestClient
from transformers import AutoTokenizer

from poolserve.config.core import core_configs
from poolserve.config.models_file import served_models
from poolserve.config.pooler import parse_pooler_config
from poolserve.config.settings import ServerSettings
from poolserve.engine.host import CoreThread
from poolserve.frontend.client import EngineClient
from poolserve.http.app import create_app
from poolserve.types.params import PoolingParams
from poolserve.types.tasks import PoolingTask
from tests.http.serving import assert_close
from tests.tiny_encoders import build_hf_encoder, encoder_dirs
from tests.tiny_rerankers import build_cross_encoder, save_cross_encoder

MEAN, SIGMA = 0.3, 2.0
CALIBRATED = {"logit_mean": MEAN, "logit_sigma": SIGMA}
DEPRECATED = {"logit_bias": MEAN, "logit_scale": 1 / SIGMA}  # sigma = 1 / logit_scale
QUERY = "what is the capital of france"
DOCUMENTS = ["paris is the capital of france", "a recipe for bread", "berlin is in germany"]
TEXTS = ["a happy little sentence", "an angry and much longer sentence about nothing at all"]


def _calibrated(logits: torch.Tensor) -> torch.Tensor:
    return (logits - MEAN) / SIGMA


@pytest.fixture(scope="module")
def cross_encoder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_cross_encoder("bert_cls", tmp_path_factory.mktemp("ce"))


@pytest.fixture(scope="module")
def encoders(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], Path]:
    return encoder_dirs(tmp_path_factory)


def _client(model: Path, config: dict[str, Any] | None) -> TestClient:
    settings = ServerSettings(
        model=str(model),
        served_model_name="m",
        max_model_len=64,
        pooler_config=None if config is None else json.dumps(config),
    )
    return TestClient(create_app(settings))


def _post(client: TestClient, path: str, **body: Any) -> Any:
    response = client.post(path, json=body)
    assert response.status_code == 200, response.text
    return response.json()


def _pair_logits(directory: Path) -> torch.Tensor:
    """transformers' one logit of (QUERY, document), laid out by the tokenizer, per document."""
    tokenizer = AutoTokenizer.from_pretrained(str(directory))
    model = build_cross_encoder("bert_cls")
    encoded = tokenizer([QUERY] * len(DOCUMENTS), DOCUMENTS, padding=True, return_tensors="pt")
    with torch.inference_mode():
        return model(**encoded).logits[:, 0]


@pytest.mark.parametrize("config", [CALIBRATED, DEPRECATED], ids=["new", "deprecated"])
def test_cross_encoder_scores_and_ranks_calibrated_logits(
    cross_encoder: Path, config: dict[str, Any]
) -> None:
    logits = _pair_logits(cross_encoder)
    want = torch.sigmoid(_calibrated(logits))
    with _client(cross_encoder, config) as client:
        scored = _post(client, "/v1/score", text_1=QUERY, text_2=DOCUMENTS)
        raw = _post(client, "/v1/score", text_1=QUERY, text_2=DOCUMENTS, use_activation=False)
        ranked = _post(client, "/v1/rerank", query=QUERY, documents=DOCUMENTS)
        # a reward stays the classifier's raw score (vLLM calibrates its classifier heads)
        reward = _post(client, "/v1/pooling", input=[QUERY], task="reward")
    assert_close([d["score"] for d in scored["data"]], want)
    assert_close([d["score"] for d in raw["data"]], _calibrated(logits))
    by_index = {r["index"]: r["relevance_score"] for r in ranked["results"]}
    assert_close([by_index[i] for i in range(len(DOCUMENTS))], want)
    assert [r["index"] for r in ranked["results"]] == torch.argsort(-want).tolist()
    tokenizer = AutoTokenizer.from_pretrained(str(cross_encoder))
    with torch.inference_mode():
        plain = build_cross_encoder("bert_cls")(**tokenizer([QUERY], return_tensors="pt"))
    assert_close(reward["data"][0]["data"], plain.logits[0])


def test_classifier_probabilities_and_logits(encoders: Callable[[str], Path]) -> None:
    directory = encoders("bert_cls")
    tokenizer = AutoTokenizer.from_pretrained(str(directory))
    with torch.inference_mode():
        encoded = tokenizer(TEXTS, padding=True, return_tensors="pt")
        logits = build_hf_encoder("bert_cls")(**encoded).logits  # [texts, 3]
    with _client(directory, CALIBRATED) as client:
        probs = _post(client, "/v1/classify", input=TEXTS)
        raw = _post(client, "/v1/classify", input=TEXTS, use_activation=False)
    for index in range(len(TEXTS)):
        calibrated = _calibrated(logits[index])
        assert_close(probs["data"][index]["probs"], torch.softmax(calibrated, dim=-1))
        assert_close(raw["data"][index]["probs"], calibrated)


def test_token_classifier_per_token(encoders: Callable[[str], Path]) -> None:
    directory = encoders("roberta_tokcls")
    tokenizer = AutoTokenizer.from_pretrained(str(directory))
    model = build_hf_encoder("roberta_tokcls")
    with _client(directory, DEPRECATED) as client:
        answer = _post(client, "/v1/pooling", input=TEXTS, task="token_classify")
    for item, text in zip(answer["data"], TEXTS, strict=True):
        with torch.inference_mode():
            logits = model(**tokenizer(text, return_tensors="pt")).logits[0]  # [T, 5]
        assert_close(item["data"], torch.softmax(_calibrated(logits), dim=-1))


def test_the_engine_core_applies_them_for_every_front_end(cross_encoder: Path) -> None:
    """Front ends in other processes send prompts to the core; the core's heads calibrate."""
    settings = ServerSettings(model=str(cross_encoder), pooler_config=json.dumps(CALIBRATED))
    core = CoreThread(list(core_configs(served_models(settings))))
    core.start()
    tokenizer = AutoTokenizer.from_pretrained(str(cross_encoder))
    encoded = [tokenizer(QUERY, document) for document in DOCUMENTS]

    async def one_front_end() -> list[float]:
        client = EngineClient(core.paths[0], timeout_s=10.0)
        await client.connect()
        try:
            futures = await client.submit_many(
                [e["input_ids"] for e in encoded],
                PoolingParams(task=PoolingTask.SCORE),
                token_type_ids=[e["token_type_ids"] for e in encoded],
            )
            return [float(o.data[0]) for o in await asyncio.gather(*futures)]
        finally:
            await client.close()

    try:
        want = torch.sigmoid(_calibrated(_pair_logits(cross_encoder)))
        for _ in range(2):  # two front ends, one after the other
            assert_close(np.array(asyncio.run(one_front_end())), want)
    finally:
        core.stop()


@pytest.mark.parametrize(
    ("config", "message"),
    [
        ({"logit_sigma": 0}, "logit_sigma cannot be 0 (division by zero)"),
        ({"logit_scale": 0}, "logit_scale cannot be 0 (division by zero)"),
        ({"logit_bias": 1, "logit_mean": 1}, "Cannot set both `logit_bias` and `logit_mean`"),
        ({"logit_scale": 1, "logit_sigma": 1}, "Cannot set both `logit_scale` and `logit_sigma`"),
        ({"logit_mean": "high"}, "logit_mean: Input should be a valid number"),
    ],
)
def test_refused_at_start(cross_encoder: Path, config: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=f"^--pooler-config: {re.escape(message)}"):
        parse_pooler_config(json.dumps(config))
    with pytest.raises(ValueError, match=re.escape(message)), _client(cross_encoder, config):
        pass
