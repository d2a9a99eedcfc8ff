"""bge-m3's sparse and ColBERT outputs: a weight per token kept per token id, projected tokens.

Sparse: each token's weight is relu(sparse_linear(hidden)), one number; a token id's weight is
the largest of its tokens', the tokenizer's CLS, EOS, PAD and UNK left out and weights of zero
dropped (FlagEmbedding's `lexical_weights`). The ids are known on the host, so the method finds
each request's distinct ids there and the device only reduces `[num_tokens]` weights into
`[num_ids]` slots: no vocabulary-sized buffer. ColBERT: colbert_linear of every token after CLS
(EOS included), each vector L2-normalized (FlagEmbedding's `colbert_vecs`). The three together
(EMBED_M3, for the combined pair score): one prompt's dense vector, lexical weights and ColBERT
vectors from the same chunks, packed as one output's parts.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from poolserve.pooling.heads import SEQUENCE_REDUCERS, EmbeddingHead, Head, run_fp32
from poolserve.pooling.methods import AllPool, PoolingMethod
from poolserve.pooling.stats import CloneStats
from poolserve.types.errors import PoolingConfigError
from poolserve.types.model_info import M3_COLBERT, M3_SPARSE, PoolingModelInfo
from poolserve.types.outputs import parts_header
from poolserve.types.params import PoolingParams
from poolserve.types.tasks import PoolingType


def _to_device(values: np.ndarray, device: torch.device) -> torch.Tensor:
    """A host array on the device; on CUDA through pinned memory, without waiting for it."""
    tensor = torch.from_numpy(values)
    if device.type != "cuda":
        return tensor
    return tensor.pin_memory().to(device, non_blocking=True)


class LexicalPool(PoolingMethod):
    """Each token's weight, then per distinct kept token id the largest: `[2, ids]` (ids as
    float32 ascending, their weights; zeros still in)."""

    pooling_type = PoolingType.LEXICAL

    def __init__(
        self,
        sparse_linear: nn.Module,
        excluded_ids: frozenset[int],
        *,
        async_scheduling: bool,
        stats: CloneStats,
    ) -> None:
        super().__init__(async_scheduling=async_scheduling, stats=stats)
        self._linear = sparse_linear
        self._excluded = np.array(sorted(excluded_ids), dtype=np.int64)
        self._weights: list[torch.Tensor] = []  # [n] float32 per chunk, new storage
        self._ids: list[np.ndarray] = []  # [n] int64 per chunk, on the host

    def add_chunk(
        self, hidden: torch.Tensor, token_ids: Sequence[int], is_last: bool
    ) -> torch.Tensor | None:
        """Weigh this chunk's tokens; reduce them per token id on the last chunk."""
        weights = torch.relu(run_fp32(self._linear, hidden.float())).squeeze(-1)  # [n]
        self._weights.append(weights)
        self._ids.append(np.asarray(token_ids, dtype=np.int64))
        if not is_last:
            return None
        ids = np.concatenate(self._ids)  # [N]
        kept = ~np.isin(ids, self._excluded)  # [N]
        distinct, slots = np.unique(ids[kept], return_inverse=True)  # [U], [kept]
        # an excluded token goes to one extra slot, dropped below
        all_slots = np.full(ids.shape, len(distinct), dtype=np.int64)  # [N]
        all_slots[kept] = slots
        device = weights.device
        found = torch.zeros(len(distinct) + 1, device=device)  # [U + 1]; weights are >= 0
        found.scatter_reduce_(0, _to_device(all_slots, device), torch.cat(self._weights), "amax")
        columns = _to_device(distinct.astype(np.float32), device)  # [U], exact below 2**24
        self.close()
        return torch.stack([columns, found[: len(distinct)]])  # [2, U]

    def close(self) -> None:
        """Drop the kept weights and ids."""
        self._weights.clear()
        self._ids.clear()


class LexicalHead(Head):
    """The ids whose weight is above zero, with their weights: `[2, nnz]`."""

    def __call__(self, pooled: torch.Tensor) -> torch.Tensor:
        """`[2, U]` -> `[2, nnz]` (nonzero waits for the device: its size depends on the data)."""
        kept = pooled[1].nonzero().squeeze(1)  # [nnz]
        return pooled[:, kept]


class ColbertVectorsHead(Head):
    """colbert_linear of every token after CLS, L2-normalized per token unless asked not to."""

    def __init__(self, colbert_linear: nn.Module, normalize: bool) -> None:
        self.colbert_linear = colbert_linear
        self.normalize = normalize

    def __call__(self, pooled: torch.Tensor) -> torch.Tensor:
        """`[T, hidden]` -> `[T - 1, dim]`."""
        vectors = run_fp32(self.colbert_linear, pooled[1:].float())  # [T - 1, dim]
        return F.normalize(vectors, p=2.0, dim=-1) if self.normalize else vectors


class M3Pool(PoolingMethod):
    """bge-m3's three outputs of one prompt from the same chunks, as FlagEmbedding's
    compute_score takes them from one forward: the dense vector (the embed task's), the lexical
    weights (`LexicalPool`, then `LexicalHead`) and the ColBERT vectors, packed as parts
    `[1, D]`, `[2, nnz]`, `[T - 1, dim]` (types/outputs.py)."""

    pooling_type = PoolingType.ALL  # every position is read

    def __init__(
        self, info: PoolingModelInfo, *, async_scheduling: bool, stats: CloneStats
    ) -> None:
        super().__init__(async_scheduling=async_scheduling, stats=stats)
        self._reduce = SEQUENCE_REDUCERS[info.embed_pooling_type]
        self._dense = EmbeddingHead(info.embed_projection, None, normalize=True)
        self._colbert = ColbertVectorsHead(_m3_module(info, M3_COLBERT), normalize=True)
        self._lexical = lexical_method(info, async_scheduling=False, stats=stats)
        # the rows are read in the step of the last chunk and never returned: no clone for async
        self._rows = AllPool(async_scheduling=False, stats=stats)

    def add_chunk(
        self, hidden: torch.Tensor, token_ids: Sequence[int], is_last: bool
    ) -> torch.Tensor | None:
        """Weigh and keep this chunk's tokens; the packed parts on the last chunk."""
        weights = self._lexical.add_chunk(hidden, token_ids, is_last)  # [2, U] on the last
        rows = self._rows.add_chunk(hidden, token_ids, is_last)  # [T, hidden] on the last
        if weights is None or rows is None:
            return None
        dense = self._dense(self._reduce(rows))[None]  # [1, D]
        parts = (dense, LexicalHead()(weights), self._colbert(rows))
        header = parts_header([(p.shape[0], p.shape[1]) for p in parts])
        head = torch.tensor(header, dtype=torch.float32, device=rows.device)
        return torch.cat([head, *(p.float().reshape(-1) for p in parts)])

    def close(self) -> None:
        """Drop the kept rows and weights."""
        self._lexical.close()
        self._rows.close()


class PartsHead(Head):
    """The method packed the outputs (M3Pool): nothing is left to compute."""

    def __call__(self, pooled: torch.Tensor) -> torch.Tensor:
        """The packed parts as they are (new storage: never a view of the step's buffer)."""
        return pooled


def _m3_module(info: PoolingModelInfo, key: str) -> nn.Module:
    if info.m3_heads is None:
        raise PoolingConfigError("model info lacks m3_heads")
    return info.m3_heads[key]


def lexical_method(
    info: PoolingModelInfo, *, async_scheduling: bool, stats: CloneStats
) -> PoolingMethod:
    """The request's bge-m3 sparse method over its sparse_linear."""
    return LexicalPool(
        _m3_module(info, M3_SPARSE),
        info.sparse_excluded_ids,
        async_scheduling=async_scheduling,
        stats=stats,
    )


def lexical_head(info: PoolingModelInfo, params: PoolingParams) -> Head:
    """The request's bge-m3 sparse head (nothing in it depends on the request)."""
    return LexicalHead()


def colbert_vectors_head(info: PoolingModelInfo, params: PoolingParams) -> Head:
    """The request's bge-m3 ColBERT head: normalized unless the request says normalize false."""
    normalize = True if params.normalize is None else params.normalize
    return ColbertVectorsHead(_m3_module(info, M3_COLBERT), normalize)


def m3_method(
    info: PoolingModelInfo, *, async_scheduling: bool, stats: CloneStats
) -> PoolingMethod:
    """The request's bge-m3 method of all three outputs (EMBED_M3)."""
    return M3Pool(info, async_scheduling=async_scheduling, stats=stats)


def parts_head(info: PoolingModelInfo, params: PoolingParams) -> Head:
    """EMBED_M3's head: its method packed everything (nothing in it depends on the request)."""
    return PartsHead()
