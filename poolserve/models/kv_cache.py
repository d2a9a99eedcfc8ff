"""Paged KV cache tensors, one key and one value tensor per layer."""

from __future__ import annotations

import torch

from poolserve.models.spec import ModelSpec


class PagedKVCache:
    """Per-layer K/V pages shaped [num_blocks, block_size, num_kv_heads, head_dim]."""

    def __init__(
        self,
        spec: ModelSpec,
        num_blocks: int,
        block_size: int,
        device: torch.device,
        dtype: torch.dtype,
    ) -> None:
        if num_blocks <= 0 or block_size <= 0:
            raise ValueError("num_blocks and block_size must be positive")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.num_kv_heads = spec.num_kv_heads
        self.head_dim = spec.head_dim
        shape = (num_blocks, block_size, spec.num_kv_heads, spec.head_dim)
        # Uninitialised on purpose: a slot is read only after its chunk wrote it, and on CPU the
        # pages of an empty tensor are committed only when first written, so a cache sized for
        # the longest prompt costs memory only as long prompts actually use it.
        self.key_caches = [
            torch.empty(shape, device=device, dtype=dtype) for _ in range(spec.num_layers)
        ]
        self.value_caches = [
            torch.empty(shape, device=device, dtype=dtype) for _ in range(spec.num_layers)
        ]

    def flat_keys(self, layer: int) -> torch.Tensor:
        """Keys of one layer per slot: [num_blocks * block_size, num_kv_heads, head_dim]."""
        return self.key_caches[layer].view(-1, self.num_kv_heads, self.head_dim)

    def flat_values(self, layer: int) -> torch.Tensor:
        """Values of one layer per slot: [num_blocks * block_size, num_kv_heads, head_dim]."""
        return self.value_caches[layer].view(-1, self.num_kv_heads, self.head_dim)

    def write(
        self,
        layer: int,
        key: torch.Tensor,  # [num_write, num_kv_heads, head_dim]
        value: torch.Tensor,  # [num_write, num_kv_heads, head_dim]
        slot_mapping: torch.Tensor,  # [num_write] int64
    ) -> None:
        """Stores new keys and values at their cache slots."""
        self.flat_keys(layer).index_copy_(0, slot_mapping, key.to(self.key_caches[layer].dtype))
        self.flat_values(layer).index_copy_(
            0, slot_mapping, value.to(self.value_caches[layer].dtype)
        )
