"""One request's pooler (method + head) and the per-step split of packed hidden states."""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from poolserve.pooling.heads import Head
from poolserve.pooling.methods import PoolingMethod
from poolserve.pooling.stats import CloneStats
from poolserve.types.errors import PoolingStateError
from poolserve.types.tasks import PoolingType


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
    def head(self) -> Head:
        """The request's head (requests pooled together share one kind: `batch_key`)."""
        return self._head

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

    def batch_key(self, chunk: ChunkInput) -> tuple[PoolingType, Hashable] | None:
        """Equal for requests whose chunk can be pooled together with one reduction and one head
        call: each a whole prompt in its last chunk, the same method and the same head."""
        if not chunk.is_last or not self._is_open or self._is_abandoned:
            return None
        if chunk.num_tokens == 0 or chunk.num_tokens != len(chunk.token_ids):
            return None  # add_chunk refuses it, for this request alone
        kind, head = self._method.whole_prompt(), self._head.batch_key()
        return None if kind is None or head is None else (kind, head)

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
    """Feed each request its slice of `[num_tokens, hidden]`; one request's error is its own.

    Requests of the same kind whose whole prompt is in this step (`RequestPooler.batch_key`) are
    pooled together: a step of short prompts would otherwise cost a few small tensor operations
    per request, which on a small model cost more than its forward.
    """
    if len(chunks) != len(poolers):
        raise PoolingStateError(f"{len(chunks)} chunks for {len(poolers)} poolers")
    counts = [chunk.num_tokens for chunk in chunks]
    if sum(counts) != hidden.shape[0]:
        raise PoolingStateError(
            f"chunks hold {sum(counts)} tokens but hidden states have {hidden.shape[0]} rows"
        )
    results: list[PooledChunk | None] = [None] * len(chunks)
    groups: dict[tuple[PoolingType, Hashable], list[int]] = {}
    for i, (pooler, chunk) in enumerate(zip(poolers, chunks, strict=True)):
        key = pooler.batch_key(chunk)
        if key is not None:
            groups.setdefault(key, []).append(i)
    starts = np.cumsum([0, *counts[:-1]])
    for (kind, _), members in groups.items():
        if len(members) > 1:
            _pool_together(hidden, kind, starts, counts, members, poolers, results)
    # Host-side counts: splitting needs no device sync.
    slices = hidden.split(counts)  # each [num_tokens_i, hidden], views
    return [
        done if done is not None else _pool_one(pooler, part, chunk)
        for done, pooler, part, chunk in zip(results, poolers, slices, chunks, strict=True)
    ]


def _pool_together(
    hidden: torch.Tensor,
    kind: PoolingType,
    starts: np.ndarray,
    counts: list[int],
    members: list[int],
    poolers: Sequence[RequestPooler],
    results: list[PooledChunk | None],
) -> None:
    """One reduction and one head call for `members` (whole prompts, the same method and head).

    The rows are a fresh tensor, never a view of the step's buffer, so nothing needs a clone
    whatever the scheduling. Should it fail, each member is pooled alone, its error its own.
    """
    first, sizes = starts[members], np.asarray([counts[i] for i in members])
    try:
        with torch.no_grad():
            pooled = _whole_rows(hidden, kind, first, sizes)  # [len(members), hidden]
            outputs = poolers[members[0]].head(pooled)  # [len(members), out]
    except Exception:
        return
    for row, i in enumerate(members):
        poolers[i].close()  # as after its last chunk: its output was pooled with the others'
        results[i] = PooledChunk(output=outputs[row])


def _whole_rows(
    hidden: torch.Tensor, kind: PoolingType, first: np.ndarray, sizes: np.ndarray
) -> torch.Tensor:
    """Each prompt's pooled row: its first, its last, or the mean of its rows (float32)."""
    device = hidden.device
    if kind is PoolingType.CLS:
        return hidden.index_select(0, torch.from_numpy(first).to(device))
    if kind is PoolingType.LAST:
        return hidden.index_select(0, torch.from_numpy(first + sizes - 1).to(device))
    # MEAN: the prompts' rows, each summed into its own row, over its count. index_add_ adds
    # the rows one after another: in float64, as MeanPool sums, so a long prompt's mean is the
    # exact mean rounded once to float32, however it was batched or chunked.
    total = int(sizes.sum())
    rows = np.arange(total) + np.repeat(first - np.cumsum([0, *sizes[:-1]]), sizes)
    owner = np.repeat(np.arange(len(sizes)), sizes)
    picked = hidden.index_select(0, torch.from_numpy(rows).to(device)).double()
    sums = torch.zeros(len(sizes), hidden.shape[1], dtype=torch.float64, device=device)
    sums.index_add_(0, torch.from_numpy(owner).to(device), picked)
    counts = torch.from_numpy(sizes).to(device=device, dtype=torch.float64)[:, None]
    return (sums / counts).float()


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
