"""One request's pooler (method + head) and the per-step split of packed hidden states."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from poolserve.pooling.errors import PoolingStateError
from poolserve.pooling.heads import Head
from poolserve.pooling.methods import PoolingMethod
from poolserve.pooling.params import PoolingType
from poolserve.pooling.stats import CloneStats


@dataclass(frozen=True)
class ChunkInput:
    """One request's chunk in a step: its token count and host token ids."""

    num_tokens: int
    token_ids: Sequence[int]
    is_last: bool


class RequestPooler:
    """Per-request pooling state: created with the request, closed when it ends or is cancelled."""

    def __init__(self, method: PoolingMethod, head: Head, stats: CloneStats) -> None:
        self._method = method
        self._head = head
        self._stats = stats
        self._is_open = True
        # Set by the scheduler's thread while a step holding this request may be running on the
        # model thread: a plain flag read before each chunk, so no lock is needed.
        self._is_abandoned = False
        stats.num_open_poolers += 1

    @property
    def is_open(self) -> bool:
        """False once the last chunk was pooled or the request was closed."""
        return self._is_open

    @property
    def is_abandoned(self) -> bool:
        """True once the request failed or was cancelled: its later chunks are skipped."""
        return self._is_abandoned

    @property
    def pooling_type(self) -> PoolingType:
        """The pooling method this request runs."""
        return self._method.pooling_type

    def abandon(self) -> None:
        """Skip this request's later chunks; `close()` still drops the state."""
        self._is_abandoned = True

    def add_chunk(
        self, hidden: torch.Tensor, token_ids: Sequence[int], is_last: bool
    ) -> torch.Tensor | None:
        """Pool one chunk `[n, hidden]`; on the last chunk the float32 output, else None."""
        if not self._is_open:
            raise PoolingStateError("chunk given to a pooler that is already finished or closed")
        if hidden.shape[0] == 0 or hidden.shape[0] != len(token_ids):
            raise PoolingStateError(
                f"chunk has {hidden.shape[0]} hidden rows and {len(token_ids)} token ids"
            )
        try:
            with torch.no_grad():
                pooled = self._method.add_chunk(hidden, token_ids, is_last)
                output = None if pooled is None else self._head(pooled)
        except BaseException:
            # The state may be half-updated: no later chunk of this request can be pooled.
            self.abandon()
            self.close()
            raise
        if is_last:
            self.close()
        return output

    def close(self) -> None:
        """Drop cached state (finish or cancellation); idempotent."""
        if not self._is_open:
            return
        self._method.close()
        self._is_open = False
        self._stats.num_open_poolers -= 1


@dataclass(frozen=True)
class PooledChunk:
    """What pooling one request's chunk gave: its output on the last chunk, or its error."""

    output: torch.Tensor | None = None
    error: Exception | None = None


def pool_chunks(
    hidden: torch.Tensor, chunks: Sequence[ChunkInput], poolers: Sequence[RequestPooler]
) -> list[PooledChunk]:
    """Feed each request its slice of `[num_tokens, hidden]`; one request's error is its own."""
    if len(chunks) != len(poolers):
        raise PoolingStateError(f"{len(chunks)} chunks for {len(poolers)} poolers")
    counts = [chunk.num_tokens for chunk in chunks]
    if sum(counts) != hidden.shape[0]:
        raise PoolingStateError(
            f"chunks hold {sum(counts)} tokens but hidden states have {hidden.shape[0]} rows"
        )
    # Host-side counts: splitting needs no device sync.
    slices = hidden.split(counts)  # each [num_tokens_i, hidden], views
    return [
        _pool_one(pooler, part, chunk)
        for pooler, part, chunk in zip(poolers, slices, chunks, strict=True)
    ]


def _pool_one(pooler: RequestPooler, hidden: torch.Tensor, chunk: ChunkInput) -> PooledChunk:
    """One request's chunk; an abandoned request's rows are ignored (they were packed anyway)."""
    if pooler.is_abandoned:
        return PooledChunk()
    try:
        return PooledChunk(output=pooler.add_chunk(hidden, chunk.token_ids, chunk.is_last))
    except Exception as exc:
        return PooledChunk(error=exc)


def pool_step(
    hidden: torch.Tensor, chunks: Sequence[ChunkInput], poolers: Sequence[RequestPooler]
) -> list[torch.Tensor | None]:
    """`pool_chunks` for callers that treat the step as a whole: the first error is raised."""
    pooled = pool_chunks(hidden, chunks, poolers)
    for result in pooled:
        if result.error is not None:
            raise result.error
    return [result.output for result in pooled]
