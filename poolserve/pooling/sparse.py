"""SPLADE sparse embeddings: a running max of MLM-head logits, then log1p(relu), kept sparse.

SPLADE's weight of vocabulary entry v is max over tokens t of log(1 + relu(logit[t, v])). Both
log1p and relu are monotone, so the max commutes with them: the method keeps only a running max
of the raw logits (`[vocab]` float32) across chunks and the head applies log1p(relu) once. Logits
are computed in row blocks of at most BLOCK_ELEMENTS values, so a long prompt never holds a
`[num_tokens, vocab]` tensor, and only the non-zero entries ever reach the host.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch
from torch import nn

from poolserve.pooling.heads import Head, run_fp32
from poolserve.pooling.methods import PoolingMethod
from poolserve.pooling.stats import CloneStats
from poolserve.types.errors import PoolingConfigError
from poolserve.types.model_info import PoolingModelInfo
from poolserve.types.params import PoolingParams
from poolserve.types.tasks import PoolingType

# Logits computed at once: [rows, vocab] float32 stays within 16 MiB whatever the vocabulary.
BLOCK_ELEMENTS = 1 << 22
# Vocabulary ids travel to the host as float32 next to their weights: exact below 2**24.
MAX_VOCAB_SIZE = 1 << 24


def vocab_size_of(mlm_head: nn.Module) -> int:
    """The vocabulary the head decodes to: its last Linear's output width."""
    linears = [m for m in mlm_head.modules() if isinstance(m, nn.Linear)]
    if not linears:
        raise PoolingConfigError("the MLM head has no Linear decoder")
    vocab_size = linears[-1].out_features
    if vocab_size > MAX_VOCAB_SIZE:
        raise PoolingConfigError(f"vocabulary of {vocab_size} ids exceeds {MAX_VOCAB_SIZE}")
    return vocab_size


def kept_runs(token_ids: Sequence[int], excluded: np.ndarray) -> list[tuple[int, int]]:
    """[start, end) runs of positions whose id is not excluded, found on the host (no sync)."""
    ids = np.asarray(token_ids, dtype=np.int64)  # [n]
    kept = (~np.isin(ids, excluded)).astype(np.int8)  # [n]
    edges = np.flatnonzero(np.diff(kept, prepend=0, append=0))  # starts and ends, alternating
    return list(zip(edges[0::2].tolist(), edges[1::2].tolist(), strict=True))


class SparsePool(PoolingMethod):
    """Running max over the non-excluded tokens of the MLM head's logits, `[vocab]` float32."""

    pooling_type = PoolingType.SPARSE

    def __init__(
        self,
        mlm_head: nn.Module,
        excluded_ids: frozenset[int],
        *,
        async_scheduling: bool,
        stats: CloneStats,
    ) -> None:
        super().__init__(async_scheduling=async_scheduling, stats=stats)
        self._head = mlm_head
        self._excluded = np.array(sorted(excluded_ids), dtype=np.int64)
        self._vocab_size = vocab_size_of(mlm_head)
        self._rows = max(1, BLOCK_ELEMENTS // self._vocab_size)
        self._max: torch.Tensor | None = None  # [vocab] float32, owned (a fresh reduction)

    def add_chunk(
        self, hidden: torch.Tensor, token_ids: Sequence[int], is_last: bool
    ) -> torch.Tensor | None:
        """Fold this chunk's kept rows into the running max; return it on the last chunk."""
        for start, end in kept_runs(token_ids, self._excluded):
            for first in range(start, end, self._rows):
                block = hidden[first : min(first + self._rows, end)]  # [rows, hidden], a view
                logits = run_fp32(self._head, block.float())  # [rows, vocab]
                self._fold(logits.amax(dim=0))  # [vocab]
        if not is_last:
            return None
        result = self._max
        if result is None:  # every token excluded: nothing scores above zero
            result = torch.full((self._vocab_size,), float("-inf"), device=hidden.device)
        self.close()
        return result

    def _fold(self, block_max: torch.Tensor) -> None:
        """max(running, block) in place: one `[vocab]` buffer for the whole request."""
        if self._max is None:
            self._max = block_max
        else:
            torch.maximum(self._max, block_max, out=self._max)

    def close(self) -> None:
        """Drop the running max."""
        self._max = None


class SparseHead(Head):
    """log1p(relu) of the pooled logits, kept sparse: `[2, nnz]` (ids as float32, weights)."""

    def __call__(self, pooled: torch.Tensor) -> torch.Tensor:
        """`[vocab]` max logits -> `[2, nnz]`: row 0 the ascending ids, row 1 their weights."""
        weights = torch.log1p(torch.relu(pooled.float()))  # [vocab]
        # nonzero waits for the device (its size is data-dependent): the price of copying only
        # the non-zero entries to the host instead of the whole vocabulary
        ids = weights.nonzero().squeeze(1)  # [nnz] int64, ascending
        return torch.stack([ids.float(), weights[ids]])  # [2, nnz]


def sparse_method(
    info: PoolingModelInfo, *, async_scheduling: bool, stats: CloneStats
) -> PoolingMethod:
    """The request's SPLADE method over the model's MLM head."""
    if info.mlm_head is None:
        raise PoolingConfigError("model info lacks mlm_head")
    return SparsePool(
        info.mlm_head, info.sparse_excluded_ids, async_scheduling=async_scheduling, stats=stats
    )


def sparse_head(info: PoolingModelInfo, params: PoolingParams) -> Head:
    """The request's SPLADE head (nothing in it depends on the request)."""
    return SparseHead()
