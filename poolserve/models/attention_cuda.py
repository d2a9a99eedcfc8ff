"""CUDA backend: flash varlen attention over packed queries and paged-cache keys."""

from __future__ import annotations

import inspect
import logging
from collections.abc import Callable
from typing import Any

import torch

from poolserve.models.attention import AttentionBias, AttentionMetadata, write_new_kv
from poolserve.models.attention_cpu import ReferenceAttention
from poolserve.models.kv_cache import PagedKVCache

logger = logging.getLogger(__name__)

_FLASH_DTYPES = frozenset({torch.float16, torch.bfloat16})
_MAX_FLASH_HEAD_DIM = 256


def find_varlen_attn() -> Callable[..., Any] | None:
    """torch.nn.attention.varlen.varlen_attn when the installed torch provides it."""
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        return None
    return varlen_attn


class CudaAttention:
    """One varlen flash call per layer; per-sequence SDPA where the kernel cannot serve."""

    def __init__(self, varlen: Callable[..., Any] | None = None, device_type: str = "cuda") -> None:
        # varlen and device_type are injectable so the kernel-call logic is testable off-GPU.
        self._varlen = varlen or find_varlen_attn()
        self._device_type = device_type
        self._params: frozenset[str] = frozenset()
        if self._varlen is not None:
            self._params = frozenset(inspect.signature(self._varlen).parameters)
        self._fallback = ReferenceAttention()
        logger.info("CUDA attention: varlen_attn %s", "found" if self._varlen else "missing")

    @property
    def uses_varlen(self) -> bool:
        """Whether the flash varlen kernel is available at all."""
        return self._varlen is not None

    def can_use_varlen(
        self, query: torch.Tensor, sliding_window: int | None, softcap: float | None = None
    ) -> bool:
        """Whether the flash kernel handles this dtype, head size, mask and logit cap."""
        # torch's varlen_attn has no soft-capping: Gemma2 layers take the reference path.
        if self._varlen is None or query.device.type != self._device_type or softcap is not None:
            return False
        if query.dtype not in _FLASH_DTYPES:
            return False
        head_dim = query.shape[-1]
        if head_dim % 8 or head_dim > _MAX_FLASH_HEAD_DIM:
            return False
        return sliding_window is None or "window_size" in self._params

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
        """Writes continuing sequences' K/V, then one varlen call over every sequence."""
        # The flash kernel adds no score bias: MPNet and DeBERTa layers take the reference path.
        if bias is not None or not self.can_use_varlen(query, sliding_window, softcap):
            return self._fallback.attend(
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
        keys, values = _key_stream(key, value, layer, meta, kv_cache)
        kwargs = self._kwargs(meta.causal, sliding_window, scale)
        if query.shape[1] != keys.shape[1] and "enable_gqa" not in self._params:
            group = query.shape[1] // keys.shape[1]
            keys = keys.repeat_interleave(group, dim=1)  # [total_k, num_heads, head_dim]
            values = values.repeat_interleave(group, dim=1)  # [total_k, num_heads, head_dim]
        varlen = self._varlen
        assert varlen is not None  # can_use_varlen checked it
        out = varlen(
            query,
            keys.contiguous(),
            values.contiguous(),
            meta.cu_seqlens_q,
            meta.cu_seqlens_k,
            meta.max_seqlen_q,
            meta.max_seqlen_k,
            **kwargs,
        )
        # Some torch releases return (out, aux...) from the public wrapper.
        return out[0] if isinstance(out, tuple) else out

    def _kwargs(self, causal: bool, sliding_window: int | None, scale: float) -> dict[str, Any]:
        """Keyword arguments in the dialect of the installed varlen_attn."""
        kwargs: dict[str, Any] = {}
        if "window_size" in self._params:
            # The kernel keeps keys with q - left <= k <= q + right; the models keep
            # q - k < window, and |q - k| < window when bidirectional.
            left = -1 if sliding_window is None else sliding_window - 1
            kwargs["window_size"] = (left, 0) if causal else (left, left)
        else:
            kwargs["is_causal"] = causal
        if "scale" in self._params:
            kwargs["scale"] = scale
        if "enable_gqa" in self._params:
            kwargs["enable_gqa"] = True
        return kwargs


def _key_stream(
    key: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    value: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    layer: int,
    meta: AttentionMetadata,
    kv_cache: PagedKVCache | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Packed keys per sequence: its cached pages gathered in order, then its new keys."""
    if not meta.has_context:
        return key, value
    if kv_cache is None or meta.context_slots is None or meta.kv_gather_index is None:
        raise ValueError("a sequence has cached context but no kv_cache was given")
    cached_k = kv_cache.flat_keys(layer).index_select(0, meta.context_slots)  # [num_ctx, kv, d]
    cached_v = kv_cache.flat_values(layer).index_select(0, meta.context_slots)  # [num_ctx, kv, d]
    keys = torch.cat([cached_k, key.to(cached_k.dtype)]).index_select(0, meta.kv_gather_index)
    values = torch.cat([cached_v, value.to(cached_v.dtype)]).index_select(0, meta.kv_gather_index)
    return keys.to(key.dtype), values.to(value.dtype)  # [total_k, num_kv_heads, head_dim] each
