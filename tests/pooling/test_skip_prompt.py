"""Prompt-skipping CLS and MEAN (sentence-transformers include_prompt: false) across chunks."""

from __future__ import annotations

import pytest
import torch

from poolserve.pooling.heads import TokenEmbeddingHead
from poolserve.pooling.methods import build_method
from poolserve.pooling.pooler import RequestPooler
from poolserve.pooling.stats import CloneStats
from poolserve.types.tasks import PoolingType
from tests.pooling.util import CHUNK_SIZES, assert_close, feed_chunked

NUM_TOKENS = 20


def _pooled(
    kind: PoolingType, skip: int, chunk: int | None, async_scheduling: bool
) -> torch.Tensor:
    hidden = torch.randn(NUM_TOKENS, 8, generator=torch.Generator().manual_seed(skip))
    stats = CloneStats()
    method = build_method(kind, async_scheduling=async_scheduling, stats=stats, skip_tokens=skip)
    pooler = RequestPooler(method, TokenEmbeddingHead(normalize=False), stats)
    return feed_chunked(pooler, hidden, list(range(NUM_TOKENS)), chunk, async_scheduling)


@pytest.mark.parametrize("chunk", CHUNK_SIZES)
@pytest.mark.parametrize("async_scheduling", [False, True])
@pytest.mark.parametrize("skip", [1, 6, 13, NUM_TOKENS])
def test_skipping_pools_equal_the_masked_reference(
    chunk: int | None, async_scheduling: bool, skip: int
) -> None:
    hidden = torch.randn(NUM_TOKENS, 8, generator=torch.Generator().manual_seed(skip))
    # sentence-transformers zeroes the first `skip` mask positions: MEAN averages the rest (a zero
    # vector when none is left), CLS takes the first unmasked row (row 0 when none is left)
    mean = hidden[skip:].mean(0) if skip < NUM_TOKENS else torch.zeros(8)
    cls = hidden[skip] if skip < NUM_TOKENS else hidden[0]
    assert_close(_pooled(PoolingType.MEAN, skip, chunk, async_scheduling), mean)
    assert_close(_pooled(PoolingType.CLS, skip, chunk, async_scheduling), cls)
