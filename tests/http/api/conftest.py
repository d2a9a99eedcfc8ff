"""The vLLM scoring ports' served models, shared by test_vllm_score.py and test_vllm_rerank.py:
a cross-encoder, a bi-encoder and a ColBERT model, each with the reference of its scores."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch.nn.functional as F
from sentence_transformers import CrossEncoder, SentenceTransformer

from tests.http.api.vllm_checks import ColBERTReference, Served, save_tiny_colbert
from tests.http.serving import started_client
from tests.tiny_rerankers import save_cross_encoder


@pytest.fixture(scope="session")
def cross_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_cross_encoder("xlmroberta_cls", tmp_path_factory.mktemp("xlmr") / "ce")


@pytest.fixture(scope="session")
def cross(cross_dir: Path) -> Iterator[Served]:
    # vLLM: BAAI/bge-reranker-base --max-model-len 100
    reference = CrossEncoder(str(cross_dir), device="cpu")
    with started_client(lambda _: cross_dir, "reranker", max_model_len=100) as started:
        yield Served(started, "reranker", lambda pairs: reference.predict(pairs).tolist())


@pytest.fixture(scope="session")
def bi(minilm_dir: Path) -> Iterator[Served]:
    # vLLM: BAAI/bge-base-en-v1.5 --max-model-len 100
    st = SentenceTransformer(str(minilm_dir), device="cpu")

    def cosines(pairs: list[list[str]]) -> list[float]:
        scores = []
        for pair in pairs:
            query, document = st.encode(pair, convert_to_tensor=True)
            scores.append(float(F.cosine_similarity(query, document, dim=0)))
        return scores

    with started_client(lambda _: minilm_dir, "embedder", max_model_len=100) as started:
        yield Served(started, "embedder", cosines)


@pytest.fixture(scope="session")
def colbert(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    # vLLM: answerdotai/answerai-colbert-small-v1 --max-model-len 512
    directory = save_tiny_colbert(tmp_path_factory.mktemp("colbert") / "m")
    reference = ColBERTReference(directory)
    with started_client(lambda _: directory, "colbert", max_model_len=512) as started:
        yield Served(started, "colbert", reference.predict)
