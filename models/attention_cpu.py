"""Reference attention backend: SDPA per sequence over cached + new keys (any device)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from models.attention import AttentionMetadata, write_new_kv
from models.kv_cache import PagedKVCache


def allowed_keys(
    num_context: int, num_new: int, sliding_window: int | None, device: torch.device
) -> torch.Tensor:  # [num_new, num_context + num_new] bool
    """Lower-right causal mask; a sliding window keeps keys with q_pos - k_pos < window."""
    q_pos = torch.arange(num_context, num_context + num_new, device=device)[:, None]
    k_pos = torch.arange(num_context + num_new, device=device)[None, :]
    allowed = k_pos <= q_pos
    if sliding_window is not None:
        allowed &= k_pos > q_pos - sliding_window
    return allowed


def _needs_mask(causal: bool, num_context: int, num_new: int, window: int | None) -> bool:
    """Whether plain is_causal (or no mask) is not enough for this sequence."""
    window_bites = window is not None and num_context + num_new > window
    return causal and (num_context > 0 or window_bites)


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
    ) -> torch.Tensor:  # [num_tokens, num_heads, head_dim]
        """Writes continuing sequences' K/V, then attends sequence by sequence."""
        write_new_kv(key, value, layer=layer, meta=meta, kv_cache=kv_cache)
        out = torch.empty_like(query)
        gqa = query.shape[1] != key.shape[1]
        for i in range(meta.num_seqs):
            start, num_new = meta.query_starts[i], meta.seq_lens_q[i]
            stop = start + num_new
            keys, values = self._keys(key[start:stop], value[start:stop], i, layer, meta, kv_cache)
            num_context = meta.context_lens[i]
            mask = None
            if _needs_mask(meta.causal, num_context, num_new, sliding_window):
                mask = allowed_keys(num_context, num_new, sliding_window, query.device)
            # A leading batch dimension matters: torch's CPU flash kernel takes only 4-D inputs,
            # 3-D ones fall back to the math path, 2-3x slower on long prompts.
            attended = F.scaled_dot_product_attention(
                query[start:stop].transpose(0, 1)[None],  # [1, num_heads, num_new, head_dim]
                keys.transpose(0, 1)[None],  # [1, num_kv_heads, num_keys, head_dim]
                values.transpose(0, 1)[None],  # [1, num_kv_heads, num_keys, head_dim]
                attn_mask=mask,
                is_causal=meta.causal and mask is None,
                scale=scale,
                enable_gqa=gqa,
            )
            out[start:stop] = attended[0].transpose(0, 1)
        return out

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
