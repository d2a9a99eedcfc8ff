"""Attention backends: the CUDA backend's kernel-call logic against the CPU reference, off-GPU."""

from __future__ import annotations

import random
from typing import Any

import pytest
import torch

from poolserve.models import AttentionMetadata, PagedKVCache, build_attention_metadata
from poolserve.models.attention_cpu import ReferenceAttention
from poolserve.models.attention_cuda import CudaAttention
from poolserve.models.spec import HeadKind, ModelSpec
from tests.models.driver import assert_close

CPU = torch.device("cpu")
HEADS, KV_HEADS, HEAD_DIM, BLOCK = 4, 2, 8, 8
SEQ_LENS_Q = [1, 13, 40, 5]
CONTEXT_LENS = [0, 20, 0, 33]
WRITE_KV = [False, True, True, False]


def _flash_semantics(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    cu_q: torch.Tensor,
    cu_k: torch.Tensor,
    scale: float,
    left: int,
    right: int,
) -> torch.Tensor:
    """Flash varlen semantics in float32: bottom-right aligned, keys k in [q - left, q + right]."""
    out = torch.empty(query.shape, dtype=torch.float32)
    group = query.shape[1] // key.shape[1]
    for i in range(len(cu_q) - 1):
        q = query[cu_q[i] : cu_q[i + 1]].float().transpose(0, 1)  # [H, lq, D]
        k = key[cu_k[i] : cu_k[i + 1]].float().repeat_interleave(group, 1).transpose(0, 1)
        v = value[cu_k[i] : cu_k[i + 1]].float().repeat_interleave(group, 1).transpose(0, 1)
        lq, lk = q.shape[1], k.shape[1]
        q_pos = torch.arange(lq)[:, None] + (lk - lq)
        k_pos = torch.arange(lk)[None, :]
        keep = torch.ones(lq, lk, dtype=torch.bool)
        if right >= 0:
            keep &= k_pos <= q_pos + right
        if left >= 0:
            keep &= k_pos >= q_pos - left
        scores = (q @ k.transpose(1, 2) * scale).masked_fill(~keep, float("-inf"))
        out[cu_q[i] : cu_q[i + 1]] = (scores.softmax(-1) @ v).transpose(0, 1)
    return out.to(query.dtype)


def modern_varlen(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    cu_seq_q: torch.Tensor,
    cu_seq_k: torch.Tensor,
    max_q: int,
    max_k: int,
    *,
    return_aux: Any = None,
    scale: float | None = None,
    window_size: tuple[int, int] = (-1, -1),
    enable_gqa: bool = False,
    seqused_k: Any = None,
    block_table: Any = None,
    num_splits: Any = None,
) -> torch.Tensor:
    """Stand-in with the keyword dialect of recent torch releases."""
    assert enable_gqa or key.shape[1] == query.shape[1]
    scale = query.shape[-1] ** -0.5 if scale is None else scale
    return _flash_semantics(query, key, value, cu_seq_q, cu_seq_k, scale, *window_size)


def legacy_varlen(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    cu_seq_q: torch.Tensor,
    cu_seq_k: torch.Tensor,
    max_q: int,
    max_k: int,
    is_causal: bool = False,
) -> torch.Tensor:
    """Stand-in with the first release's dialect: is_causal only, no GQA, default scale."""
    assert key.shape[1] == query.shape[1]
    right = 0 if is_causal else -1
    return _flash_semantics(
        query, key, value, cu_seq_q, cu_seq_k, query.shape[-1] ** -0.5, -1, right
    )


def _spec() -> ModelSpec:
    return ModelSpec(
        architecture="test",
        family="test",
        is_causal=True,
        hidden_size=HEADS * HEAD_DIM,
        vocab_size=10,
        num_layers=1,
        num_kv_heads=KV_HEADS,
        head_dim=HEAD_DIM,
        max_model_len=512,
        dtype=torch.float32,
        head_kind=HeadKind.NONE,
        num_labels=None,
        labels=(),
        supports_matryoshka=False,
        matryoshka_dimensions=None,
    )


def _case(causal: bool) -> tuple[AttentionMetadata, list[torch.Tensor], PagedKVCache]:
    """Random q/k/v and a cache holding random context, in bf16-representable values."""
    context = CONTEXT_LENS if causal else [0] * 4
    write = WRITE_KV if causal else [False] * 4
    needed = [-(-(c + n) // BLOCK) for c, n in zip(context, SEQ_LENS_Q, strict=True)]
    ids = list(range(sum(needed)))
    random.Random(1).shuffle(ids)
    tables = [ids[sum(needed[:i]) : sum(needed[: i + 1])] for i in range(4)]
    meta = build_attention_metadata(
        seq_lens_q=SEQ_LENS_Q,
        context_lens=context,
        write_kv=write,
        block_tables=tables,
        block_size=BLOCK,
        device=CPU,
        causal=causal,
    )
    gen = torch.Generator().manual_seed(0)
    tokens = sum(SEQ_LENS_Q)
    qkv = [
        torch.randn(tokens, h, HEAD_DIM, generator=gen).bfloat16().float()
        for h in (HEADS, KV_HEADS, KV_HEADS)
    ]
    cache = PagedKVCache(_spec(), len(ids), BLOCK, CPU, torch.float32)
    for tensor in cache.key_caches + cache.value_caches:
        tensor.copy_(torch.randn(tensor.shape, generator=gen).bfloat16())
    return meta, qkv, cache


def _bf16_cache(cache: PagedKVCache) -> PagedKVCache:
    copy = PagedKVCache(_spec(), cache.num_blocks, cache.block_size, CPU, torch.bfloat16)
    for target, source in zip(
        copy.key_caches + copy.value_caches, cache.key_caches + cache.value_caches, strict=True
    ):
        target.copy_(source)
    return copy


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("window", [None, 6])
@pytest.mark.parametrize("varlen", [modern_varlen, legacy_varlen])
def test_cuda_backend_logic_matches_reference(
    causal: bool, window: int | None, varlen: Any
) -> None:
    window = window if causal else None
    meta, (q, k, v), cache = _case(causal)
    fast_cache = _bf16_cache(cache)
    backend = CudaAttention(varlen=varlen, device_type="cpu")
    uses_kernel = backend.can_use_varlen(q.bfloat16(), window)
    assert uses_kernel == (window is None or varlen is modern_varlen)
    kwargs: dict[str, Any] = {
        "layer": 0,
        "meta": meta,
        "sliding_window": window,
        "scale": HEAD_DIM**-0.5,
    }
    fast = backend.attend(q.bfloat16(), k.bfloat16(), v.bfloat16(), kv_cache=fast_cache, **kwargs)
    reference = ReferenceAttention().attend(q, k, v, kv_cache=cache, **kwargs)
    assert_close(fast.float(), reference, rel=2e-2)
    for written, expected in zip(
        fast_cache.key_caches + fast_cache.value_caches,
        cache.key_caches + cache.value_caches,
        strict=True,
    ):
        assert torch.equal(written.float(), expected)


def test_float32_falls_back_to_the_reference() -> None:
    backend = CudaAttention(varlen=modern_varlen, device_type="cpu")
    assert not backend.can_use_varlen(torch.zeros(2, HEADS, HEAD_DIM), None)
    assert not backend.can_use_varlen(torch.zeros(2, HEADS, 12, dtype=torch.bfloat16), None)
