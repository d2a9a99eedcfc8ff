"""CPU attention: the per-sequence SDPA reference, and one batched call per equal-length bucket."""

from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.nn.functional as F

from poolserve.models.attention import AttentionBias, AttentionMetadata, write_new_kv
from poolserve.models.attention_buckets import SequenceBucket
from poolserve.models.kv_cache import PagedKVCache
from poolserve.models.layers import softcap as apply_softcap


def allowed_keys(
    num_context: int,
    num_new: int,
    sliding_window: int | None,
    device: torch.device,
    causal: bool = True,
) -> torch.Tensor:  # [num_new, num_context + num_new] bool
    """Lower-right causal mask with q - k < window; bidirectional: |q - k| < window."""
    q_pos = torch.arange(num_context, num_context + num_new, device=device)[:, None]
    k_pos = torch.arange(num_context + num_new, device=device)[None, :]
    if causal:
        allowed = k_pos <= q_pos
    else:
        allowed = torch.ones(num_new, num_context + num_new, dtype=torch.bool, device=device)
    if sliding_window is not None:
        allowed &= (q_pos - k_pos).abs() < sliding_window
    return allowed


def _needs_mask(causal: bool, num_context: int, num_new: int, window: int | None) -> bool:
    """Whether plain is_causal (or no mask) is not enough for this sequence."""
    window_bites = window is not None and num_context + num_new > window
    return window_bites or (causal and num_context > 0)


def _softcapped(
    query: torch.Tensor,  # [1, num_heads, num_new, head_dim]
    keys: torch.Tensor,  # [1, num_kv_heads, num_keys, head_dim]
    values: torch.Tensor,  # [1, num_kv_heads, num_keys, head_dim]
    allowed: torch.Tensor | None,  # [num_new, num_keys] bool
    scale: float,
    cap: float,
) -> torch.Tensor:  # [1, num_heads, num_new, head_dim]
    """Attention with tanh-capped logits, which SDPA cannot do; softmax in float32 like Gemma2."""
    group = query.shape[1] // keys.shape[1]
    keys = keys.repeat_interleave(group, dim=1)  # [1, num_heads, num_keys, head_dim]
    values = values.repeat_interleave(group, dim=1)  # [1, num_heads, num_keys, head_dim]
    scores = apply_softcap(query @ keys.transpose(-1, -2) * scale, cap)  # [1, H, new, keys]
    if allowed is not None:
        scores = scores.masked_fill(~allowed, float("-inf"))
    probs = scores.softmax(-1, dtype=torch.float32).to(query.dtype)  # [1, H, new, keys]
    return probs @ values


def _sequence_mask(
    meta: AttentionMetadata,
    seq: int,
    sliding_window: int | None,
    softcap: float | None,
    bias: AttentionBias | None,
    device: torch.device,
) -> torch.Tensor | None:  # [num_new, num_keys] bool, or [1, num_heads, num_new, num_keys] float
    """One sequence's mask: none, allowed keys, or its score bias with -inf at barred keys."""
    start, num_new, num_context = (
        meta.query_starts[seq],
        meta.seq_lens_q[seq],
        meta.context_lens[seq],
    )
    needs_mask = _needs_mask(meta.causal, num_context, num_new, sliding_window)
    # The soft-capped path has no is_causal shortcut, and SDPA takes no is_causal with a bias.
    if softcap is None and not needs_mask and (bias is None or not meta.causal):
        return None if bias is None else bias(start, start + num_new)[None]
    allowed = allowed_keys(num_context, num_new, sliding_window, device, meta.causal)
    if bias is None:
        return allowed
    return bias(start, start + num_new).masked_fill(~allowed, float("-inf"))[None]


def _attend_sequence(
    query: torch.Tensor,  # [1, num_heads, num_new, head_dim]
    keys: torch.Tensor,  # [1, num_kv_heads, num_keys, head_dim]
    values: torch.Tensor,  # [1, num_kv_heads, num_keys, head_dim]
    mask: torch.Tensor | None,  # [num_new, num_keys] bool, or a float score bias
    causal: bool,
    scale: float,
    cap: float | None,
) -> torch.Tensor:  # [1, num_heads, num_new, head_dim]
    """One sequence's attention: SDPA, or the explicit soft-capped form."""
    if cap is not None:
        if mask is not None and mask.dtype != torch.bool:
            raise ValueError("soft-capped attention takes no score bias")
        return _softcapped(query, keys, values, mask, scale, cap)
    return F.scaled_dot_product_attention(
        query,
        keys,
        values,
        attn_mask=mask,
        is_causal=causal and mask is None,
        scale=scale,
        enable_gqa=query.shape[1] != keys.shape[1],
    )


class ReferenceAttention:
    """Per-sequence scaled_dot_product_attention; the correctness reference for every backend."""

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
        """Writes continuing sequences' K/V, then attends sequence by sequence."""
        write_new_kv(key, value, layer=layer, meta=meta, kv_cache=kv_cache)
        out = torch.empty_like(query)
        self._attend_each(
            range(meta.num_seqs),
            (query, key, value, out),
            layer=layer,
            meta=meta,
            kv_cache=kv_cache,
            sliding_window=sliding_window,
            scale=scale,
            softcap=softcap,
            bias=bias,
        )
        return out

    def _attend_each(
        self,
        seqs: Iterable[int],
        tensors: tuple[torch.Tensor, ...],  # query, key, value, out: [num_tokens, heads, head_dim]
        *,
        layer: int,
        meta: AttentionMetadata,
        kv_cache: PagedKVCache | None,
        sliding_window: int | None,
        scale: float,
        softcap: float | None,
        bias: AttentionBias | None,
    ) -> None:
        """One SDPA call per sequence in seqs over its own views; writes its rows of out."""
        query, key, value, out = tensors
        for i in seqs:
            start, num_new = meta.query_starts[i], meta.seq_lens_q[i]
            stop = start + num_new
            keys, values = self._keys(key[start:stop], value[start:stop], i, layer, meta, kv_cache)
            mask = _sequence_mask(meta, i, sliding_window, softcap, bias, query.device)
            # A leading batch dimension matters: torch's CPU flash kernel takes only 4-D inputs,
            # 3-D ones fall back to the math path, 2-3x slower on long prompts.
            attended = _attend_sequence(
                query[start:stop].transpose(0, 1)[None],  # [1, num_heads, num_new, head_dim]
                keys.transpose(0, 1)[None],  # [1, num_kv_heads, num_keys, head_dim]
                values.transpose(0, 1)[None],  # [1, num_kv_heads, num_keys, head_dim]
                mask,
                meta.causal,
                scale,
                softcap,
            )  # [1, num_heads, num_new, head_dim]
            out[start:stop] = attended[0].transpose(0, 1)

    @staticmethod
    def _keys(
        new_keys: torch.Tensor,  # [num_new, num_kv_heads, head_dim]
        new_values: torch.Tensor,  # [num_new, num_kv_heads, head_dim]
        seq: int,
        layer: int,
        meta: AttentionMetadata,
        kv_cache: PagedKVCache | None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The sequence's cached keys/values followed by its new ones."""
        num_context = meta.context_lens[seq]
        if num_context == 0:
            return new_keys, new_values
        if kv_cache is None or meta.context_slots is None:
            raise ValueError("a sequence has cached context but no kv_cache was given")
        first = meta.context_starts[seq]
        slots = meta.context_slots[first : first + num_context]  # [num_context]
        keys = torch.cat(
            [kv_cache.flat_keys(layer)[slots], new_keys.to(kv_cache.key_caches[0].dtype)]
        )
        values = torch.cat(
            [kv_cache.flat_values(layer)[slots], new_values.to(kv_cache.value_caches[0].dtype)]
        )
        return keys.to(new_keys.dtype), values.to(new_values.dtype)


def _attend_bucket(
    tensors: tuple[torch.Tensor, ...],  # query, key, value, out: [num_tokens, heads, head_dim]
    bucket: SequenceBucket,
    causal: bool,
    sliding_window: int | None,
    scale: float,
) -> None:
    """One SDPA call over a bucket's members as a batch; writes their rows of out."""
    query, key, value, out = tensors
    num_seqs, length = bucket.num_seqs, bucket.seq_len

    def batched(x: torch.Tensor) -> torch.Tensor:  # [B, heads, seq_len, head_dim]
        rows = x.index_select(0, bucket.token_index)  # [B * seq_len, heads, head_dim]
        return rows.view(num_seqs, length, *x.shape[1:]).transpose(1, 2)

    window_bites = sliding_window is not None and length > sliding_window
    mask = allowed_keys(0, length, sliding_window, query.device, causal) if window_bites else None
    attended = F.scaled_dot_product_attention(
        batched(query),
        batched(key),
        batched(value),
        attn_mask=mask,  # [seq_len, seq_len] bool, the same for every member
        is_causal=causal and mask is None,
        scale=scale,
        enable_gqa=query.shape[1] != key.shape[1],
    )  # [B, num_heads, seq_len, head_dim], laid out like the query: [B, seq_len] rows in memory
    rows = attended.transpose(1, 2).reshape(num_seqs * length, *query.shape[1:])  # a view
    out.index_copy_(0, bucket.token_index, rows)


class BucketedAttention(ReferenceAttention):
    """One SDPA call per bucket of equal-length sequences; the reference for the rest.

    Each call has a fixed cost (dispatch, the kernel's buffers, a fork and join of the threads)
    that dominates on short prompts; a bucket pays it once for all its members.
    """

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
        """Writes continuing sequences' K/V, then attends bucket by bucket, then the rest."""
        layout = meta.buckets
        # Score biases (MPNet, DeBERTa) and soft-capped logits (Gemma2) are per-sequence forms.
        if layout is None or not layout.buckets or bias is not None or softcap is not None:
            return super().attend(
                query,
                key,
                value,
                layer=layer,
                meta=meta,
                kv_cache=kv_cache,
                sliding_window=sliding_window,
                scale=scale,
                softcap=softcap,
                bias=bias,
            )
        write_new_kv(key, value, layer=layer, meta=meta, kv_cache=kv_cache)
        out = torch.empty_like(query)
        for bucket in layout.buckets:
            _attend_bucket((query, key, value, out), bucket, meta.causal, sliding_window, scale)
        self._attend_each(
            layout.single,
            (query, key, value, out),
            layer=layer,
            meta=meta,
            kv_cache=kv_cache,
            sliding_window=sliding_window,
            scale=scale,
            softcap=None,
            bias=None,
        )
        return out
