"""Buffer ownership: outputs and cached chunks survive the next step overwriting the buffer."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from poolserve.pooling import CloneStats, PoolingModelInfo, PoolingParams, PoolingTask, build_pooler
from poolserve.pooling import methods as pooling_methods
from poolserve.pooling.pooler import RequestPooler
from poolserve.types.tasks import PoolingType
from tests.pooling.util import (
    CHUNK_SIZES,
    GARBAGE,
    SimRequest,
    assert_close,
    chunk_bounds,
    pass_through_pooler,
    run_steps,
)

HIDDEN = 16
NUM_TOKENS = 150


def _prompt(seed: int) -> tuple[torch.Tensor, list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(NUM_TOKENS, HIDDEN, generator=gen), list(range(NUM_TOKENS))


def _pool_with_overwrites(
    pooler: RequestPooler, hidden: torch.Tensor, chunk_size: int | None
) -> torch.Tensor:
    """Pool chunk by chunk, overwriting the buffer after each step; the final output."""
    buffer = torch.empty_like(hidden)
    bounds = chunk_bounds(hidden.shape[0], chunk_size)
    output = None
    for index, (start, end) in enumerate(bounds):
        buffer[: end - start] = hidden[start:end]
        output = pooler.add_chunk(
            buffer[: end - start], list(range(start, end)), index == len(bounds) - 1
        )
        buffer.fill_(GARBAGE)  # the next step reuses the buffer before this step's D2H copy
    assert output is not None
    return output


@pytest.mark.parametrize("chunk_size", CHUNK_SIZES)
@pytest.mark.parametrize("pooling_type", [PoolingType.CLS, PoolingType.LAST, PoolingType.ALL])
def test_async_outputs_survive_buffer_reuse(
    pooling_type: PoolingType, chunk_size: int | None
) -> None:
    hidden, _ = _prompt(seed=1)
    pooler = pass_through_pooler(pooling_type, async_scheduling=True, stats=CloneStats())
    output = _pool_with_overwrites(pooler, hidden, chunk_size)
    expected = {PoolingType.CLS: hidden[0], PoolingType.LAST: hidden[-1], PoolingType.ALL: hidden}
    assert_close(output, expected[pooling_type])


def _cached_after_overwrites(hidden: torch.Tensor, chunk_size: int) -> list[bool]:
    """Feed every chunk but the last, overwriting the buffer; which cached chunks stayed intact."""
    pooler = pass_through_pooler(PoolingType.ALL, async_scheduling=True, stats=CloneStats())
    buffer = torch.empty_like(hidden)
    bounds = chunk_bounds(NUM_TOKENS, chunk_size)[:-1]  # every chunk but the last: all cached
    for start, end in bounds:
        buffer[: end - start] = hidden[start:end]
        assert pooler.add_chunk(buffer[: end - start], list(range(start, end)), False) is None
        buffer.fill_(GARBAGE)
    cached = pooler._method.cached_chunks  # type: ignore[attr-defined]
    assert len(cached) == len(bounds)
    return [
        torch.equal(chunk, hidden[start:end])
        for chunk, (start, end) in zip(cached, bounds, strict=True)
    ]


@pytest.mark.parametrize("chunk_size", [1, 7, 64])
def test_cached_chunks_survive_buffer_reuse(
    monkeypatch: pytest.MonkeyPatch, chunk_size: int
) -> None:
    hidden, _ = _prompt(seed=2)
    assert all(_cached_after_overwrites(hidden, chunk_size))
    monkeypatch.setattr(pooling_methods, "_own", lambda tensor, stats: tensor)
    assert not any(_cached_after_overwrites(hidden, chunk_size))


@pytest.mark.parametrize("chunk_size", CHUNK_SIZES)
@pytest.mark.parametrize("pooling_type", [PoolingType.CLS, PoolingType.LAST, PoolingType.ALL])
def test_removing_the_clone_corrupts_async_outputs(
    monkeypatch: pytest.MonkeyPatch, pooling_type: PoolingType, chunk_size: int | None
) -> None:
    monkeypatch.setattr(pooling_methods, "_own", lambda tensor, stats: tensor)
    hidden, _ = _prompt(seed=3)
    pooler = pass_through_pooler(pooling_type, async_scheduling=True, stats=CloneStats())
    output = _pool_with_overwrites(pooler, hidden, chunk_size)
    expected = {PoolingType.CLS: hidden[0], PoolingType.LAST: hidden[-1], PoolingType.ALL: hidden}
    # Without the clone the output (or a cached chunk inside it) aliases the reused buffer.
    assert not torch.equal(output, expected[pooling_type]), "corruption not detected"


@pytest.mark.parametrize("token_budget", [7, 64])
def test_removing_the_clone_corrupts_batched_steps(
    monkeypatch: pytest.MonkeyPatch, token_budget: int
) -> None:
    def simulate() -> list[bool]:
        requests, expected = [], []
        for seed, length in enumerate([5, 30, 90]):
            hidden = torch.randn(length, HIDDEN, generator=torch.Generator().manual_seed(seed))
            pooler = pass_through_pooler(PoolingType.ALL, async_scheduling=True, stats=CloneStats())
            requests.append(SimRequest(pooler, hidden, tuple(range(length))))
            expected.append(hidden)
        outputs = run_steps(requests, token_budget, async_scheduling=True)
        return [torch.equal(o, e) for o, e in zip(outputs, expected, strict=True)]

    assert all(simulate())
    monkeypatch.setattr(pooling_methods, "_own", lambda tensor, stats: tensor)
    assert not all(simulate())


def test_sync_non_chunked_path_never_clones() -> None:
    hidden, ids = _prompt(seed=4)
    stats = CloneStats()
    for pooling_type in PoolingType:
        # these run a model's head and own their reduction: tests/pooling/test_sparse.py,
        # tests/models/test_bge_m3.py
        if pooling_type in (PoolingType.SPARSE, PoolingType.LEXICAL):
            continue
        pooler = pass_through_pooler(pooling_type, async_scheduling=False, stats=stats)
        pooler.add_chunk(hidden, ids, is_last=True)
    assert stats.num_clones == 0
    assert stats.cloned_bytes == 0


def test_sync_all_pool_hands_out_a_view() -> None:
    hidden, ids = _prompt(seed=5)
    pooler = pass_through_pooler(PoolingType.ALL, async_scheduling=False, stats=CloneStats())
    out = pooler.add_chunk(hidden, ids, is_last=True)
    assert out is not None
    assert out.data_ptr() == hidden.data_ptr()


@pytest.mark.parametrize("async_scheduling", [False, True])
@pytest.mark.parametrize("chunk_size", [1, 7, 64])
def test_chunked_path_clones_only_cached_chunks(async_scheduling: bool, chunk_size: int) -> None:
    hidden, _ = _prompt(seed=6)
    stats = CloneStats()
    pooler = pass_through_pooler(PoolingType.ALL, async_scheduling=async_scheduling, stats=stats)
    _pool_with_overwrites(pooler, hidden, chunk_size)
    bounds = chunk_bounds(NUM_TOKENS, chunk_size)
    cached_rows = sum(end - start for start, end in bounds[:-1])
    # The last chunk joins the cached ones by concatenation: never cloned itself.
    assert stats.num_clones == len(bounds) - 1
    assert stats.cloned_bytes == cached_rows * HIDDEN * hidden.element_size()


def test_async_single_chunk_clones_once() -> None:
    hidden, ids = _prompt(seed=7)
    stats = CloneStats()
    pooler = pass_through_pooler(PoolingType.ALL, async_scheduling=True, stats=stats)
    pooler.add_chunk(hidden, ids, is_last=True)
    assert stats.num_clones == 1
    assert stats.cloned_bytes == hidden.numel() * hidden.element_size()


def test_chunked_cls_counts_its_kept_row() -> None:
    hidden, ids = _prompt(seed=8)
    stats = CloneStats()
    pooler = pass_through_pooler(PoolingType.CLS, async_scheduling=False, stats=stats)
    pooler.add_chunk(hidden[:10], ids[:10], is_last=False)
    pooler.add_chunk(hidden[10:], ids[10:], is_last=True)
    assert (stats.num_clones, stats.cloned_bytes) == (1, HIDDEN * hidden.element_size())


def _token_info() -> PoolingModelInfo:
    score = nn.Linear(HIDDEN, 3)
    return PoolingModelInfo(
        is_decoder=True, hidden_size=HIDDEN, token_classifier=score, num_labels=3
    )


def test_computing_head_needs_no_clone_under_async() -> None:
    hidden, ids = _prompt(seed=9)
    stats = CloneStats()
    params = PoolingParams(task=PoolingTask.TOKEN_CLASSIFY)
    pooler = build_pooler(_token_info(), params, async_scheduling=True, stats=stats)
    out = pooler.add_chunk(hidden, ids, is_last=True)
    hidden.fill_(GARBAGE)
    assert out is not None and not (out == GARBAGE).any()
    assert stats.num_clones == 0


def test_raw_token_embed_clones_under_async() -> None:
    hidden, ids = _prompt(seed=10)
    expected = hidden.clone()
    stats = CloneStats()
    info = PoolingModelInfo(is_decoder=True, hidden_size=HIDDEN)
    params = PoolingParams(task=PoolingTask.TOKEN_EMBED, normalize=False)
    pooler = build_pooler(info, params, async_scheduling=True, stats=stats)
    out = pooler.add_chunk(hidden, ids, is_last=True)
    hidden.fill_(GARBAGE)
    assert out is not None and torch.equal(out, expected)
    assert stats.num_clones == 1
