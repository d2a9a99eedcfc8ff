"""--dtype bfloat16 and --quantization int8 served: the same answers' shape, embeddings close to
sentence-transformers' float32 (bounds of docs/models.md, Precision)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import pytest

from tests.tiny_models import minilm_path

TEXTS = [
    "A quantized model keeps most of its accuracy.",
    "int8",
    "The quick brown fox jumps over the lazy dog, again and again, until the dog wakes up.",
]
BOUNDS = {"bfloat16": 0.999, "int8": 0.99}


@pytest.fixture(scope="module")
def st_embeddings() -> np.ndarray:
    """sentence-transformers' float32 MiniLM embeddings of TEXTS."""
    from sentence_transformers import SentenceTransformer

    model = SentenceTransformer(str(minilm_path()), device="cpu")
    return np.asarray(model.encode(TEXTS, normalize_embeddings=True))


@pytest.mark.parametrize(
    ("settings", "bound"),
    [({"dtype": "bfloat16"}, BOUNDS["bfloat16"]), ({"quantization": "int8"}, BOUNDS["int8"])],
    ids=["bfloat16", "int8"],
)
def test_served_embeddings_stay_close(
    make_client: Callable[..., Any],
    st_embeddings: np.ndarray,
    settings: dict[str, Any],
    bound: float,
) -> None:
    # fidelity, whatever the precision's speed on this CPU class (measured at start)
    with make_client(None, allow_slower_precision=True, **settings) as client:
        response = client.post("/v1/embeddings", json={"model": "minilm", "input": TEXTS})
    assert response.status_code == 200, response.text
    got = np.array([item["embedding"] for item in response.json()["data"]], dtype=np.float32)
    assert got.shape == st_embeddings.shape
    cosines = np.sum(got * st_embeddings, axis=1) / np.linalg.norm(got, axis=1)
    assert cosines.min() >= bound, cosines
