"""The vLLM scoring ports' served models, shared by test_vllm_score.py and test_vllm_rerank.py:
a cross-encoder, a bi-encoder and a ColBERT model, each a real `poolserve serve` process
(`live_servers`) with the reference of its scores."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch.nn.functional as F
from sentence_transformers import CrossEncoder, SentenceTransformer

from tests.http.api.vllm_checks import ColBERTReference, Served, save_tiny_colbert
from tests.http.serving import LiveServers
from tests.tiny_rerankers import save_cross_encoder


@pytest.fixture(scope="session")
def cross_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_cross_encoder("xlmroberta_cls", tmp_path_factory.mktemp("xlmr") / "ce")


@pytest.fixture(scope="session")
def cross(live_servers: LiveServers, cross_dir: Path) -> Served:
    # vLLM: BAAI/bge-reranker-base --max-model-len 100
    server = live_servers.serve(cross_dir, "reranker", max_model_len=100)
    reference = CrossEncoder(str(cross_dir), device="cpu")
    return Served(server, "reranker", lambda pairs: reference.predict(pairs).tolist())


@pytest.fixture(scope="session")
def bi(live_servers: LiveServers, minilm_dir: Path) -> Served:
    # vLLM: BAAI/bge-base-en-v1.5 --max-model-len 100
    server = live_servers.serve(minilm_dir, "embedder", max_model_len=100)
    st = SentenceTransformer(str(minilm_dir), device="cpu")

    def cosines(pairs: list[list[str]]) -> list[float]:
        scores = []
        for pair in pairs:
            query, document = st.encode(pair, convert_to_tensor=True)
            scores.append(float(F.cosine_similarity(query, document, dim=0)))
        return scores

    return Served(server, "embedder", cosines)


@pytest.fixture(scope="session")
def colbert(live_servers: LiveServers, tmp_path_factory: pytest.TempPathFactory) -> Served:
    # vLLM: answerdotai/answerai-colbert-small-v1 --max-model-len 512
    directory = save_tiny_colbert(tmp_path_factory.mktemp("colbert") / "m")
    server = live_servers.serve(directory, "colbert", max_model_len=512)
    reference = ColBERTReference(directory)
    return Served(server, "colbert", reference.predict)
