"""huggingface_hub's InferenceClient (which speaks TEI) against a real `poolserve serve` process."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from huggingface_hub import InferenceClient

from tests.deploy.live import poolserve_server

pytestmark = pytest.mark.slow
TEXTS = ["What is Deep Learning?", "Today is a nice day", "paris is the capital of france"]


@pytest.fixture(scope="module")
def client(tmp_path_factory: pytest.TempPathFactory) -> Iterator[InferenceClient]:
    with poolserve_server(tmp_path_factory.mktemp("tei_client")) as live:
        yield InferenceClient(base_url=live.base_url)


@pytest.fixture(scope="module")
def reference(minilm_dir: Path) -> Any:
    from sentence_transformers import SentenceTransformer

    return SentenceTransformer(str(minilm_dir), device="cpu")


def _cosines(got: np.ndarray, want: np.ndarray) -> np.ndarray:
    got = got / np.linalg.norm(got, axis=-1, keepdims=True)
    want = want / np.linalg.norm(want, axis=-1, keepdims=True)
    return np.sum(got * want, axis=-1)


def test_feature_extraction_equals_sentence_transformers(
    client: InferenceClient, reference: Any
) -> None:
    want = reference.encode(TEXTS)
    got = client.feature_extraction(TEXTS)
    assert got.shape == want.shape and got.dtype == np.float32
    assert _cosines(got, want).min() >= 0.9999
    one = client.feature_extraction(TEXTS[0], normalize=True, truncate=True)
    assert one.shape == (1, want.shape[1])
    assert _cosines(one, want[:1]).min() >= 0.9999
    # normalize=False: the pooled mean itself, same direction, not unit length
    raw = client.feature_extraction(TEXTS, normalize=False, truncation_direction="right")
    assert _cosines(raw, want).min() >= 0.9999
    assert not np.allclose(np.linalg.norm(raw, axis=-1), 1.0)


def test_sentence_similarity_equals_sentence_transformers(
    client: InferenceClient, reference: Any
) -> None:
    got = client.sentence_similarity(TEXTS[0], other_sentences=TEXTS[1:])
    vectors = reference.encode(TEXTS)
    want = reference.similarity(vectors[:1], vectors[1:]).numpy()[0]
    assert len(got) == len(TEXTS) - 1
    assert np.abs(np.asarray(got) - want).max() <= 1e-4
