"""Quantized embeddings against sentence-transformers' `quantize_embeddings`."""

from __future__ import annotations

import numpy as np
import pytest
from sentence_transformers import quantize_embeddings

from poolserve.frontend.quantize import QUANTIZERS, quantize


@pytest.mark.parametrize("kind", ["int8", "uint8", "binary", "ubinary"])
def test_quantizers_follow_sentence_transformers_rule(kind: str) -> None:
    generator = np.random.default_rng(0)
    raw = generator.standard_normal((64, 100)).astype(np.float32)  # 100: not a multiple of 8
    units = raw / np.linalg.norm(raw, axis=1, keepdims=True)
    ranges = np.array([[-1.0] * 100, [1.0] * 100], dtype=np.float32)
    want = quantize_embeddings(units, precision=kind, ranges=ranges)  # type: ignore[arg-type]
    got = QUANTIZERS[kind](units)
    assert got.dtype == want.dtype and np.array_equal(got, want)
    # the 8-bit types quantise the direction: a scaled vector gives the same bytes
    if kind.endswith("int8"):
        assert np.array_equal(QUANTIZERS[kind](units * 7.5), QUANTIZERS[kind](units))


@pytest.mark.parametrize("kind", ["float", "int8", "uint8", "binary", "ubinary"])
def test_one_embedding_is_its_row_of_a_batch(kind: str) -> None:
    # fixed ranges: a text's bytes never depend on what else is in the request
    generator = np.random.default_rng(1)
    batch = generator.standard_normal((5, 40)).astype(np.float32)
    rows = np.stack([quantize(row, kind) for row in batch])
    assert np.array_equal(rows, quantize(batch, kind))


def test_a_zero_vector_quantizes_without_dividing_by_zero() -> None:
    zero = np.zeros(16, dtype=np.float32)
    assert np.array_equal(quantize(zero, "uint8"), np.full(16, 127, dtype=np.uint8))
    assert np.array_equal(quantize(zero, "ubinary"), np.zeros(2, dtype=np.uint8))
