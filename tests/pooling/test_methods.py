"""Every pooling method equals a naive reference, for any chunking and any batching."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

from poolserve.pooling import PoolingStateError
from poolserve.pooling.stats import CloneStats
from poolserve.types.tasks import PoolingType
from tests.pooling.util import (
    CHUNK_SIZES,
    SimRequest,
    assert_close,
    feed_chunked,
    pass_through_pooler,
    run_steps,
)

HIDDEN = 16
STEP_TAG = 7


def _naive_step(hidden: torch.Tensor, ids: list[int]) -> torch.Tensor:
    rows = [hidden[i] for i, t in enumerate(ids) if t == STEP_TAG]
    return torch.stack(rows) if rows else torch.zeros(0, hidden.shape[1])


# The methods over hidden states alone (SPARSE runs an MLM head: tests/pooling/test_sparse.py).
NAIVE: dict[PoolingType, Callable[[torch.Tensor, list[int]], torch.Tensor]] = {
    PoolingType.CLS: lambda h, ids: h[0],
    PoolingType.LAST: lambda h, ids: h[-1],
    PoolingType.MEAN: lambda h, ids: h.double().mean(dim=0).float(),
    PoolingType.ALL: lambda h, ids: h,
    PoolingType.STEP: _naive_step,
}


def _prompt(num_tokens: int, seed: int) -> tuple[torch.Tensor, list[int]]:
    gen = torch.Generator().manual_seed(seed)
    hidden = torch.randn(num_tokens, HIDDEN, generator=gen) * 3 + 1
    ids = torch.randint(0, 12, (num_tokens,), generator=gen).tolist()
    return hidden, ids


@pytest.mark.parametrize("async_scheduling", [False, True])
@pytest.mark.parametrize("chunk_size", CHUNK_SIZES)
@pytest.mark.parametrize("pooling_type", list(NAIVE))
def test_method_equals_naive_for_any_chunking(
    pooling_type: PoolingType, chunk_size: int | None, async_scheduling: bool
) -> None:
    hidden, ids = _prompt(150, seed=3)
    stats = CloneStats()
    pooler = pass_through_pooler(
        pooling_type, async_scheduling=async_scheduling, stats=stats, step_tag_id=STEP_TAG
    )
    out = feed_chunked(pooler, hidden, ids, chunk_size, async_scheduling)
    assert_close(out, NAIVE[pooling_type](hidden, ids))
    assert not pooler.is_open
    assert stats.num_open_poolers == 0


@pytest.mark.parametrize("chunk_size", CHUNK_SIZES)
def test_step_untagged_keeps_every_position(chunk_size: int | None) -> None:
    hidden, ids = _prompt(70, seed=4)
    pooler = pass_through_pooler(
        PoolingType.STEP, async_scheduling=True, stats=CloneStats(), step_tag_id=None
    )
    assert_close(feed_chunked(pooler, hidden, ids, chunk_size, True), hidden)


@pytest.mark.parametrize("chunk_size", CHUNK_SIZES)
def test_step_without_tag_in_prompt_is_empty(chunk_size: int | None) -> None:
    hidden, _ = _prompt(70, seed=5)
    ids = [1] * 70
    pooler = pass_through_pooler(
        PoolingType.STEP, async_scheduling=False, stats=CloneStats(), step_tag_id=STEP_TAG
    )
    out = feed_chunked(pooler, hidden, ids, chunk_size, False)
    assert out.shape == (0, HIDDEN)


@pytest.mark.parametrize("async_scheduling", [False, True])
@pytest.mark.parametrize("token_budget", [1, 7, 64, 512])
def test_batched_steps_mixing_finished_and_unfinished(
    token_budget: int, async_scheduling: bool
) -> None:
    lengths = [1, 5, 23, 64, 90, 3, 41]
    stats = CloneStats()
    requests, expected = [], []
    for index, length in enumerate(lengths * 2):
        pooling_type = list(NAIVE)[index % len(NAIVE)]
        hidden, ids = _prompt(length, seed=100 + index)
        pooler = pass_through_pooler(
            pooling_type, async_scheduling=async_scheduling, stats=stats, step_tag_id=STEP_TAG
        )
        requests.append(SimRequest(pooler, hidden, tuple(ids)))
        expected.append(NAIVE[pooling_type](hidden, ids))
    outputs = run_steps(requests, token_budget, async_scheduling)
    for out, ref in zip(outputs, expected, strict=True):
        assert_close(out, ref)
    assert stats.num_open_poolers == 0


def test_close_drops_state_and_is_idempotent() -> None:
    hidden, ids = _prompt(20, seed=6)
    stats = CloneStats()
    pooler = pass_through_pooler(PoolingType.ALL, async_scheduling=False, stats=stats)
    assert stats.num_open_poolers == 1
    assert pooler.add_chunk(hidden[:10], ids[:10], is_last=False) is None
    pooler.close()
    pooler.close()
    assert not pooler.is_open
    assert stats.num_open_poolers == 0
    with pytest.raises(PoolingStateError):
        pooler.add_chunk(hidden[10:], ids[10:], is_last=True)


def test_cancelled_chunked_request_frees_cached_chunks() -> None:
    hidden, ids = _prompt(20, seed=7)
    stats = CloneStats()
    pooler = pass_through_pooler(PoolingType.ALL, async_scheduling=False, stats=stats)
    pooler.add_chunk(hidden[:10], ids[:10], is_last=False)
    method = pooler._method  # the per-request state object
    assert len(method.cached_chunks) == 1  # type: ignore[attr-defined]
    pooler.close()
    assert method.cached_chunks == ()  # type: ignore[attr-defined]


def test_empty_or_mismatched_chunk_is_rejected() -> None:
    hidden, ids = _prompt(4, seed=8)
    pooler = pass_through_pooler(PoolingType.LAST, async_scheduling=False, stats=CloneStats())
    with pytest.raises(PoolingStateError):
        pooler.add_chunk(hidden[:0], [], is_last=True)
    pooler = pass_through_pooler(PoolingType.LAST, async_scheduling=False, stats=CloneStats())
    with pytest.raises(PoolingStateError):
        pooler.add_chunk(hidden, ids[:2], is_last=True)
