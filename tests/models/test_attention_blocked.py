"""The blocked-GEMM causal attention equals SDPA with a lower-right causal mask."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from models.attention_blocked import blocked_causal_attention
from models.attention_cpu import allowed_keys


@pytest.mark.parametrize(
    "num_context,num_new,heads,kv_heads,block",
    [
        (0, 300, 4, 2, 64),
        (0, 257, 8, 8, 256),
        (37, 100, 4, 1, 32),
        (130, 7, 6, 3, 4),
        (0, 1, 2, 2, 8),
    ],
)
def test_blocked_equals_masked_sdpa(
    num_context: int, num_new: int, heads: int, kv_heads: int, block: int
) -> None:
    torch.manual_seed(num_context + num_new)
    head_dim, scale = 16, 0.3
    query = torch.randn(num_new, heads, head_dim) * 2
    keys = torch.randn(num_context + num_new, kv_heads, head_dim) * 2
    values = torch.randn(num_context + num_new, kv_heads, head_dim)
    mask = allowed_keys(num_context, num_new, None, torch.device("cpu"))
    want = F.scaled_dot_product_attention(
        query.transpose(0, 1),
        keys.transpose(0, 1),
        values.transpose(0, 1),
        attn_mask=mask,
        scale=scale,
        enable_gqa=heads != kv_heads,
    ).transpose(0, 1)
    got = blocked_causal_attention(query, keys, values, scale, block=block)
    assert got.shape == want.shape
    assert (got - want).abs().max() <= 1e-5 * want.abs().max()
