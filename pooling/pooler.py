"""One request's pooler (method + head) and the per-step split of packed hidden states."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from pooling.errors import PoolingStateError
from pooling.heads import Head
from pooling.methods import PoolingMethod
from pooling.params import PoolingType
from pooling.stats import CloneStats


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
        stats.num_open_poolers += 1

    @property
    def is_open(self) -> bool:
        """False once the last chunk was pooled or the request was closed."""
        return self._is_open

    @property
    def pooling_type(self) -> PoolingType:
        """The pooling method this request runs."""
        return self._method.pooling_type

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


def pool_step(
    hidden: torch.Tensor, chunks: Sequence[ChunkInput], poolers: Sequence[RequestPooler]
) -> list[torch.Tensor | None]:
    """Feed each request its slice of the packed hidden states `[num_tokens, hidden]`."""
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
        pooler.add_chunk(part, chunk.token_ids, chunk.is_last)
        for pooler, part, chunk in zip(poolers, slices, chunks, strict=True)
    ]
