"""Whole prompts pooled together in one step equal each pooled alone, whatever else the step
holds (chunked prompts, prompts that skip rows, other heads, abandoned requests)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from poolserve.pooling import CloneStats, PoolingModelInfo, PoolingParams, PoolingTask, build_pooler
from poolserve.pooling.pooler import ChunkInput, RequestPooler, pool_chunks
from poolserve.types.tasks import PoolingType
from tests.pooling.util import assert_close

HIDDEN = 16
EMBED = PoolingParams(task=PoolingTask.EMBED)
SIZES = (5, 1, 9, 3, 12, 7)


def _info(pooling: PoolingType, projection: nn.Module | None = None) -> PoolingModelInfo:
    torch.manual_seed(0)
    return PoolingModelInfo(
        is_decoder=False,
        hidden_size=HIDDEN,
        default_pooling_type=pooling,
        embed_projection=projection,
        embed_output_size=None if projection is None else 8,
        supports_matryoshka=True,
    )


def _pooler(info: PoolingModelInfo, params: PoolingParams, stats: CloneStats) -> RequestPooler:
    return build_pooler(info, params, async_scheduling=True, stats=stats)


def _alone(
    info: PoolingModelInfo, params: PoolingParams, rows: torch.Tensor, stats: CloneStats
) -> torch.Tensor:
    """The request pooled by itself: a step holding only its prompt."""
    chunk = ChunkInput(rows.shape[0], list(range(rows.shape[0])), True)
    (result,) = pool_chunks(rows, [chunk], [_pooler(info, params, stats)])
    assert result.error is None and result.output is not None
    return result.output


PROJECTION = nn.Sequential(nn.Linear(HIDDEN, 8), nn.Tanh())
CASES = [
    (PoolingType.MEAN, None, EMBED),
    (PoolingType.CLS, None, EMBED),
    (PoolingType.LAST, None, EMBED),
    (PoolingType.MEAN, None, PoolingParams(task=PoolingTask.EMBED, normalize=False)),
    (PoolingType.MEAN, None, PoolingParams(task=PoolingTask.EMBED, dimensions=4)),
    (PoolingType.MEAN, PROJECTION, EMBED),
]


@pytest.mark.parametrize(("pooling", "projection", "params"), CASES)
def test_whole_prompts_together_equal_each_alone(
    pooling: PoolingType, projection: nn.Module | None, params: PoolingParams
) -> None:
    info = _info(pooling, projection)
    hidden = torch.randn(sum(SIZES), HIDDEN, generator=torch.Generator().manual_seed(1))
    stats = CloneStats()
    poolers = [_pooler(info, params, stats) for _ in SIZES]
    chunks = [ChunkInput(n, list(range(n)), True) for n in SIZES]
    together = pool_chunks(hidden, chunks, poolers)
    # one head call for all: the outputs are rows of one tensor
    storages = {r.output.untyped_storage().data_ptr() for r in together if r.output is not None}
    assert len(storages) == 1
    for result, part in zip(together, hidden.split(list(SIZES)), strict=True):
        assert result.error is None and result.output is not None
        assert_close(result.output, _alone(info, params, part.clone(), CloneStats()))
    assert not any(p.is_open for p in poolers)
    assert stats.num_open_poolers == 0


def test_a_mixed_step_pools_each_request_as_alone() -> None:
    """Whole MEAN prompts of two kinds of head, a chunked prompt, a prompt that skips rows, a
    CLS prompt alone of its kind and an abandoned request, in one step."""
    info = _info(PoolingType.MEAN)
    skip = PoolingParams(task=PoolingTask.EMBED, prompt_tokens=2)
    raw = PoolingParams(task=PoolingTask.EMBED, normalize=False)
    stats = CloneStats()
    plan = [  # (params, prompt length, tokens in this step, is last)
        (EMBED, 6, 6, True),
        (raw, 4, 4, True),
        (EMBED, 10, 3, False),  # chunked: its first chunk only
        (skip, 7, 7, True),
        (EMBED, 5, 5, True),
        (raw, 8, 8, True),
        (EMBED, 3, 3, True),  # abandoned below
    ]
    poolers = [_pooler(info, params, stats) for params, *_ in plan]
    poolers[-1].abandon()
    counts = [taken for _, _, taken, _ in plan]
    hidden = torch.randn(sum(counts), HIDDEN, generator=torch.Generator().manual_seed(2))
    chunks = [ChunkInput(taken, list(range(taken)), last) for _, _, taken, last in plan]
    results = pool_chunks(hidden, chunks, poolers)
    parts = hidden.split(counts)
    for (params, _, _, last), result, part in zip(plan[:-1], results, parts, strict=False):
        assert result.error is None
        if not last:
            assert result.output is None
            continue
        assert result.output is not None
        assert_close(result.output, _alone(info, params, part.clone(), CloneStats()))
    assert results[-1].output is None and results[-1].error is None
    assert poolers[2].is_open  # the chunked request goes on in a later step


def test_a_failing_head_fails_each_request_alone() -> None:
    """A head that raises on the rows together is retried one request at a time, so each error
    stays its request's."""
    info = _info(PoolingType.MEAN, nn.Linear(HIDDEN + 1, 8))  # does not fit the hidden size
    stats = CloneStats()
    poolers = [_pooler(info, EMBED, stats) for _ in range(3)]
    hidden = torch.randn(9, HIDDEN)
    results = pool_chunks(hidden, [ChunkInput(3, [1, 2, 3], True)] * 3, poolers)
    assert all(r.output is None and isinstance(r.error, RuntimeError) for r in results)
    assert stats.num_open_poolers == 0
