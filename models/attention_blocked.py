"""Causal attention in query blocks with batched matmuls: the CPU fast path for long sequences.

torch's CPU SDPA kernels reach a fraction of the machine's matmul rate on long causal prompts;
splitting the queries into blocks and running q @ k^T and p @ v as batched GEMMs (masking only
the diagonal block) keeps the work in BLAS, where it runs about twice as fast.
"""

from __future__ import annotations

import torch

QUERY_BLOCK = 256  # rows per block: big enough for GEMM efficiency, small enough for cache


def blocked_causal_attention(
    query: torch.Tensor,  # [num_new, num_heads, head_dim]
    keys: torch.Tensor,  # [num_context + num_new, num_kv_heads, head_dim]
    values: torch.Tensor,  # [num_context + num_new, num_kv_heads, head_dim]
    scale: float,
    block: int = QUERY_BLOCK,
) -> torch.Tensor:  # [num_new, num_heads, head_dim]
    """Lower-right causal attention (query i sees keys up to num_context + i), GQA aware."""
    num_new, num_heads, head_dim = query.shape
    num_keys, num_kv_heads, _ = keys.shape
    num_context = num_keys - num_new
    group = num_heads // num_kv_heads
    q = query.view(num_new, num_kv_heads, group, head_dim).permute(1, 2, 0, 3)  # [KV, G, N, D]
    k_t = keys.permute(1, 2, 0)  # [KV, D, K]
    v = values.permute(1, 0, 2)  # [KV, K, D]
    out = torch.empty(
        num_kv_heads, group, num_new, head_dim, dtype=query.dtype, device=query.device
    )
    for start in range(0, num_new, block):
        stop = min(num_new, start + block)
        rows = stop - start
        visible = num_context + stop  # keys this block may see
        q_block = q[:, :, start:stop].reshape(num_kv_heads, group * rows, head_dim)
        scores = torch.bmm(q_block, k_t[:, :, :visible]).mul_(scale)  # [KV, G * rows, visible]
        diagonal = scores.view(num_kv_heads, group, rows, visible)[..., num_context + start :]
        future = torch.ones(rows, rows, dtype=torch.bool, device=query.device).triu_(1)
        diagonal.masked_fill_(future, float("-inf"))  # [KV, G, rows, rows] keys after the query
        probs = torch.softmax(scores, dim=-1)  # [KV, G * rows, visible]
        attended = torch.bmm(probs, v[:, :visible])  # [KV, G * rows, D]
        out[:, :, start:stop] = attended.view(num_kv_heads, group, rows, head_dim)
    return out.permute(2, 0, 1, 3).reshape(num_new, num_heads, head_dim)
