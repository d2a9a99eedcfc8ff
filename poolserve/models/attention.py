"""Attention metadata for packed, chunked batches and the backend interface."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

import numpy as np
import torch

from poolserve.models.attention_buckets import BucketLayout, build_bucket_layout

if TYPE_CHECKING:
    from poolserve.models.kv_cache import PagedKVCache


@dataclass(frozen=True)
class AttentionMetadata:
    """Per-sequence layout of one forward: host lists plus the device tensors kernels need."""

    num_seqs: int
    num_tokens: int
    causal: bool
    block_size: int
    seq_lens_q: tuple[int, ...]
    context_lens: tuple[int, ...]
    write_kv: tuple[bool, ...]
    query_starts: tuple[int, ...]  # offset of each sequence's first new token in the stream
    context_starts: tuple[int, ...]  # offset of each sequence's cached slots in context_slots
    max_seqlen_q: int
    max_seqlen_k: int
    cu_seqlens_q: torch.Tensor  # [num_seqs + 1] int32
    cu_seqlens_k: torch.Tensor  # [num_seqs + 1] int32, cached + new keys per sequence
    slot_mapping: torch.Tensor | None  # [num_write] int64 cache slot of each written token
    write_token_index: torch.Tensor | None  # [num_write] int64 stream index of each written token
    context_slots: torch.Tensor | None  # [num_context_tokens] int64 cache slots of cached keys
    kv_gather_index: torch.Tensor | None  # [total_k] int64 into cat(cached keys, new keys)
    # CPU only: length buckets for padded batched SDPA calls (CUDA's varlen kernel needs none)
    buckets: BucketLayout | None = None

    @property
    def has_context(self) -> bool:
        """Whether any sequence continues a prompt whose earlier keys sit in the cache."""
        return self.context_slots is not None


# (start, stop) of one sequence's tokens in the stream -> the additive score bias of that
# sequence [num_heads, num_new, num_keys], already scaled; encoders' relative positions (MPNet,
# DeBERTa) are biases that depend on the sequence, and on its queries and keys.
AttentionBias = Callable[[int, int], torch.Tensor]


class AttentionBackend(Protocol):
    """Computes attention of packed queries over each sequence's cached and new keys."""

    def attend(
        self,
        query: torch.Tensor,  # [num_tokens, num_heads, head_dim]
        key: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
        value: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
        *,
        layer: int,
        meta: AttentionMetadata,
        kv_cache: PagedKVCache | None,
        sliding_window: int | None,
        scale: float,
        softcap: float | None = None,
        bias: AttentionBias | None = None,
    ) -> torch.Tensor:  # [num_tokens, num_heads, head_dim]
        """Attention output for every query token.

        A sliding window keeps keys with q - k < window, or |q - k| < window when bidirectional;
        softcap (Gemma2) maps the scaled logits through cap * tanh(logit / cap) before the mask;
        bias is added to the scaled logits of each sequence.
        """
        ...


def _slots(block_table: Sequence[int], start: int, stop: int, block_size: int) -> np.ndarray:
    """Cache slots of prompt positions start..stop-1 through one block table."""
    needed = -(-stop // block_size)
    if len(block_table) < needed:
        raise ValueError(f"block table has {len(block_table)} blocks, {needed} needed")
    positions = np.arange(start, stop, dtype=np.int64)
    table = np.asarray(block_table, dtype=np.int64)
    return table[positions // block_size] * block_size + positions % block_size


def _check_lengths(
    seq_lens_q: Sequence[int],
    context_lens: Sequence[int],
    write_kv: Sequence[bool],
    block_tables: Sequence[Sequence[int]],
    causal: bool,
) -> None:
    """Rejects inconsistent per-sequence lists before anything is built."""
    if not len(seq_lens_q) == len(context_lens) == len(write_kv) == len(block_tables):
        raise ValueError("per-sequence lists must have the same length")
    if any(n <= 0 for n in seq_lens_q) or any(c < 0 for c in context_lens):
        raise ValueError("seq_lens_q must be positive and context_lens non-negative")
    if not causal and (any(context_lens) or any(write_kv)):
        raise ValueError("bidirectional (encoder) attention cannot be chunked")


def _index_tensor(parts: list[np.ndarray], device: torch.device) -> torch.Tensor | None:
    """Concatenates host index parts into one int64 device tensor (None when empty)."""
    if not parts:
        return None
    return torch.from_numpy(np.concatenate(parts)).to(device, non_blocking=True)


def build_attention_metadata(
    *,
    seq_lens_q: Sequence[int],
    context_lens: Sequence[int],
    write_kv: Sequence[bool],
    block_tables: Sequence[Sequence[int]],
    block_size: int,
    device: torch.device,
    causal: bool,
    num_write_tokens: Sequence[int] | None = None,
) -> AttentionMetadata:
    """Builds the metadata; sequence i's new tokens sit at prompt positions ctx_i..ctx_i+n_i-1.

    A writing sequence stores the K/V of its first `num_write_tokens[i]` new tokens (all of them
    when None): a prompt's last chunk stores only the full blocks the prefix cache keeps.
    """
    _check_lengths(seq_lens_q, context_lens, write_kv, block_tables, causal)
    if num_write_tokens is None:
        num_write_tokens = seq_lens_q
    elif len(num_write_tokens) != len(seq_lens_q) or any(
        not 0 <= w <= n for w, n in zip(num_write_tokens, seq_lens_q, strict=True)
    ):
        raise ValueError("num_write_tokens must give 0..seq_len_q tokens per sequence")
    lens_q = np.asarray(seq_lens_q, dtype=np.int64)
    lens_ctx = np.asarray(context_lens, dtype=np.int64)
    cu_q = np.concatenate([[0], np.cumsum(lens_q)])
    cu_ctx = np.concatenate([[0], np.cumsum(lens_ctx)])
    cu_k = np.concatenate([[0], np.cumsum(lens_q + lens_ctx)])
    write_slots, write_index, context_slots, gather = [], [], [], []
    if any(write_kv) or cu_ctx[-1]:  # an encoder's or a whole prompt's step has nothing here
        for i, ctx in enumerate(context_lens):
            num_write = num_write_tokens[i]
            if write_kv[i] and num_write:
                write_slots.append(_slots(block_tables[i], ctx, ctx + num_write, block_size))
                write_index.append(np.arange(cu_q[i], cu_q[i] + num_write, dtype=np.int64))
            if ctx:
                context_slots.append(_slots(block_tables[i], 0, ctx, block_size))
    if context_slots:  # each sequence's cached keys, then its new ones
        for i, (n, ctx) in enumerate(zip(seq_lens_q, context_lens, strict=True)):
            gather.append(np.arange(cu_ctx[i], cu_ctx[i] + ctx, dtype=np.int64))
            gather.append(np.arange(cu_q[i], cu_q[i] + n, dtype=np.int64) + int(cu_ctx[-1]))
    return AttentionMetadata(
        num_seqs=len(seq_lens_q),
        num_tokens=int(cu_q[-1]),
        causal=causal,
        block_size=block_size,
        seq_lens_q=tuple(int(n) for n in seq_lens_q),
        context_lens=tuple(int(c) for c in context_lens),
        write_kv=tuple(bool(w) for w in write_kv),
        query_starts=tuple(int(s) for s in cu_q[:-1]),
        context_starts=tuple(int(s) for s in cu_ctx[:-1]),
        max_seqlen_q=int(lens_q.max(initial=0)),
        max_seqlen_k=int((lens_q + lens_ctx).max(initial=0)),
        cu_seqlens_q=torch.from_numpy(cu_q.astype(np.int32)).to(device, non_blocking=True),
        cu_seqlens_k=torch.from_numpy(cu_k.astype(np.int32)).to(device, non_blocking=True),
        slot_mapping=_index_tensor(write_slots, device),
        write_token_index=_index_tensor(write_index, device),
        context_slots=_index_tensor(context_slots, device),
        kv_gather_index=_index_tensor(gather, device),
        buckets=(
            build_bucket_layout(seq_lens_q, context_lens, cu_q[:-1].tolist(), device)
            if device.type == "cpu"
            else None
        ),
    )


def write_new_kv(
    key: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    value: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    *,
    layer: int,
    meta: AttentionMetadata,
    kv_cache: PagedKVCache | None,
) -> None:
    """Stores the new keys of sequences whose prompt continues in a later forward."""
    if meta.slot_mapping is None or meta.write_token_index is None:
        return
    if kv_cache is None:
        raise ValueError("metadata asks to write K/V but no kv_cache was given")
    index = meta.write_token_index
    kv_cache.write(
        layer, key.index_select(0, index), value.index_select(0, index), meta.slot_mapping
    )


def select_attention_backend(device: torch.device) -> AttentionBackend:
    """The attention backend for a device type (CUDA kernels on CUDA, length buckets elsewhere)."""
    from poolserve.models.attention_cpu import BucketedAttention
    from poolserve.models.attention_cuda import CudaAttention

    factories: dict[str, Callable[[], AttentionBackend]] = {"cuda": CudaAttention}
    return factories.get(device.type, BucketedAttention)()
