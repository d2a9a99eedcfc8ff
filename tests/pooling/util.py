"""Helpers for pooling tests: tolerance check, pass-through poolers, a tiny step simulator."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from poolserve.pooling.heads import TokenEmbeddingHead
from poolserve.pooling.methods import build_method
from poolserve.pooling.pooler import ChunkInput, RequestPooler, pool_step
from poolserve.pooling.stats import CloneStats
from poolserve.types.tasks import PoolingType

CHUNK_SIZES = (1, 7, 64, None)  # None: the whole prompt in one chunk
GARBAGE = 12345.0  # what "the next step" writes over the persistent buffer


def assert_close(actual: torch.Tensor, expected: torch.Tensor) -> None:
    """fp32 tolerance: max abs diff <= 1e-4 x the reference output's max magnitude."""
    assert actual.dtype == torch.float32
    assert actual.shape == expected.shape, (actual.shape, expected.shape)
    if expected.numel() == 0:
        return
    expected = expected.to(torch.float32)
    scale = expected.abs().max().item()
    diff = (actual - expected).abs().max().item()
    assert diff <= 1e-4 * scale, f"max abs diff {diff} vs scale {scale}"


def pass_through_pooler(
    pooling_type: PoolingType,
    *,
    async_scheduling: bool,
    stats: CloneStats,
    step_tag_id: int | None = None,
) -> RequestPooler:
    """A pooler whose head returns the pooled states unchanged (float32 input)."""
    method = build_method(
        pooling_type, async_scheduling=async_scheduling, stats=stats, step_tag_id=step_tag_id
    )
    return RequestPooler(method, TokenEmbeddingHead(normalize=False), stats)


def chunk_bounds(num_tokens: int, chunk_size: int | None) -> list[tuple[int, int]]:
    """[start, end) of each chunk when a prompt is cut into chunks of `chunk_size`."""
    size = num_tokens if chunk_size is None else chunk_size
    return [(s, min(s + size, num_tokens)) for s in range(0, num_tokens, size)]


def feed_chunked(
    pooler: RequestPooler,
    hidden: torch.Tensor,
    token_ids: Sequence[int],
    chunk_size: int | None,
    async_scheduling: bool,
) -> torch.Tensor:
    """Pool one request chunk by chunk through a reused buffer, as the runner does.

    After every step the buffer is overwritten (the next step). Without async scheduling the
    output is delivered (copied to the host) before that; with it, only afterwards.
    """
    buffer = torch.empty_like(hidden)
    bounds = chunk_bounds(hidden.shape[0], chunk_size)
    output = None
    for index, (start, end) in enumerate(bounds):
        n = end - start
        buffer[:n] = hidden[start:end]
        output = pooler.add_chunk(buffer[:n], token_ids[start:end], index == len(bounds) - 1)
        delivered = None if output is None or async_scheduling else output.clone()
        buffer.fill_(GARBAGE)
    assert output is not None
    return output if delivered is None else delivered


@dataclass(frozen=True)
class SimRequest:
    """A request for the step simulator: its pooler and its precomputed hidden states."""

    pooler: RequestPooler
    hidden: torch.Tensor  # [num_tokens, hidden]
    token_ids: tuple[int, ...]


def run_steps(
    requests: Sequence[SimRequest], token_budget: int, async_scheduling: bool
) -> list[torch.Tensor]:
    """Continuous batching under a token budget through one persistent buffer via `pool_step`.

    Outputs are delivered before the next step overwrites the buffer, or after it under async
    scheduling.
    """
    hidden_size = requests[0].hidden.shape[1]
    buffer = torch.empty(token_budget, hidden_size)
    done = [0] * len(requests)
    outputs: list[torch.Tensor | None] = [None] * len(requests)
    step = 0
    while any(out is None for out in outputs):
        order = [(i + step) % len(requests) for i in range(len(requests))]
        chunks, poolers, owners, room, used = [], [], [], token_budget, 0
        for i in order:
            req, left = requests[i], requests[i].hidden.shape[0] - done[i]
            take = min(room, left)
            if outputs[i] is not None or take == 0:
                continue
            buffer[used : used + take] = req.hidden[done[i] : done[i] + take]
            ids = req.token_ids[done[i] : done[i] + take]
            chunks.append(ChunkInput(num_tokens=take, token_ids=ids, is_last=take == left))
            poolers.append(req.pooler)
            owners.append(i)
            done[i], room, used = done[i] + take, room - take, used + take
        results = pool_step(buffer[:used], chunks, poolers)
        if async_scheduling:
            buffer.fill_(GARBAGE)
        for i, result in zip(owners, results, strict=True):
            outputs[i] = None if result is None else result.clone()  # the D2H copy
        buffer.fill_(GARBAGE)
        step += 1
    return [out for out in outputs if out is not None]
