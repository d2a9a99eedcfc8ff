"""CUDA checks (run by scripts/gpu_check.sh): bf16 forwards vs HF float32, CUDA attention vs CPU.

bf16 outputs are held to transformers' own bf16 error on the same tiny model and inputs: a fixed
cosine bound fails for transformers itself on these deliberately sharp random weights.
"""

from __future__ import annotations

import logging
import random
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from poolserve.models import PagedKVCache, build_attention_metadata, load_model
from poolserve.models.attention_cpu import ReferenceAttention
from poolserve.models.attention_cuda import CudaAttention, find_varlen_attn
from poolserve.models.spec import HeadKind, ModelSpec
from tests.models.driver import run_chunked, run_whole
from tests.tiny_models import build_hf_model

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]
logger = logging.getLogger(__name__)
CUDA = torch.device("cuda")
# poolserve's bf16 error may be this many times transformers' own bf16 error on the same inputs,
BF16_ERROR_FACTOR = 2.0
# plus two bfloat16 steps of relative precision (2**-7), below which differences are rounding.
BF16_ERROR_FLOOR = 2.0**-7


def relative_errors(ours: torch.Tensor, reference: torch.Tensor) -> torch.Tensor:
    """Per-row relative L2 error ||ours - reference|| / ||reference||, in float64."""
    a, b = ours.double().cpu(), reference.double().cpu()  # [rows, hidden]
    return (a - b).norm(dim=-1) / b.norm(dim=-1).clamp_min(1e-30)  # [rows]


def bf16_bound(hf_bf16: list[torch.Tensor], reference: list[torch.Tensor]) -> float:
    """Largest error poolserve's bf16 rows may show against the float32 reference rows."""
    hf_error = max(
        relative_errors(h, r).max().item() for h, r in zip(hf_bf16, reference, strict=True)
    )
    return BF16_ERROR_FACTOR * hf_error + BF16_ERROR_FLOOR


def hf_bf16_hidden(name: str, prompts: list[list[int]]) -> list[torch.Tensor]:
    """Last hidden states of the transformers model of a tiny spec, run in bfloat16 on CUDA."""
    backbone = build_hf_model(name).to(CUDA, torch.bfloat16).base_model
    with torch.no_grad():
        return [
            backbone(input_ids=torch.tensor([p], device=CUDA)).last_hidden_state[0].float().cpu()
            for p in prompts
        ]


@pytest.mark.parametrize("name", ["llama", "mistral", "qwen2", "qwen3", "qwen2_prm", "bert"])
def test_cuda_bf16_forward_matches_hf(
    name: str,
    tiny_model_dir: Callable[[str], Path],
    hf_hidden: Callable[[str], list[torch.Tensor]],
    prompts: list[list[int]],
) -> None:
    loaded = load_model(str(tiny_model_dir(name)), device=CUDA)
    assert loaded.spec.dtype == torch.bfloat16
    reference = hf_hidden(name)
    bound = bf16_bound(hf_bf16_hidden(name, prompts), reference)
    runs = {"whole": run_whole(loaded, prompts, CUDA)}
    if loaded.spec.is_causal:
        for size in (7, 64):
            runs[f"chunk{size}"] = run_chunked(loaded, prompts, size, CUDA)
    for label, outputs in runs.items():
        error = max(
            relative_errors(o, r).max().item() for o, r in zip(outputs, reference, strict=True)
        )
        logger.info("%s %s: relative error %.3g, bound %.3g", name, label, error, bound)
        assert error <= bound, (name, label, error, bound)


def _spec(num_kv_heads: int, head_dim: int) -> ModelSpec:
    return ModelSpec(
        architecture="test",
        family="test",
        is_causal=True,
        hidden_size=8 * head_dim,
        vocab_size=10,
        num_layers=1,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        max_model_len=4096,
        dtype=torch.bfloat16,
        head_kind=HeadKind.NONE,
        num_labels=None,
        labels=(),
        supports_matryoshka=False,
        matryoshka_dimensions=None,
    )


@pytest.mark.parametrize("window", [None, 48])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_cuda_attention_matches_cpu_reference(window: int | None, dtype: torch.dtype) -> None:
    heads, kv_heads, head_dim, block = 8, 2, 64, 16
    seq_lens_q, context = [1, 37, 130, 5, 64], [0, 50, 0, 300, 17]
    write = [False, True, True, False, True]
    needed = [-(-(c + n) // block) for c, n in zip(context, seq_lens_q, strict=True)]
    ids = list(range(sum(needed)))
    random.Random(2).shuffle(ids)
    tables = [ids[sum(needed[:i]) : sum(needed[: i + 1])] for i in range(len(needed))]
    spec = _spec(kv_heads, head_dim)
    gen = torch.Generator().manual_seed(0)
    tokens = sum(seq_lens_q)
    q, k, v = (
        torch.randn(tokens, h, head_dim, generator=gen).to(dtype).float()
        for h in (heads, kv_heads, kv_heads)
    )
    cpu_cache = PagedKVCache(spec, len(ids), block, torch.device("cpu"), torch.float32)
    gpu_cache = PagedKVCache(spec, len(ids), block, CUDA, dtype)
    for cpu_t, gpu_t in zip(
        cpu_cache.key_caches + cpu_cache.value_caches,
        gpu_cache.key_caches + gpu_cache.value_caches,
        strict=True,
    ):
        cpu_t.copy_(torch.randn(cpu_t.shape, generator=gen).to(dtype))
        gpu_t.copy_(cpu_t)
    common = {
        "seq_lens_q": seq_lens_q,
        "context_lens": context,
        "write_kv": write,
        "block_tables": tables,
        "block_size": block,
        "causal": True,
    }
    cpu_meta = build_attention_metadata(device=torch.device("cpu"), **common)  # type: ignore[arg-type]
    gpu_meta = build_attention_metadata(device=CUDA, **common)  # type: ignore[arg-type]
    backend = CudaAttention()
    logger.info(
        "varlen_attn found: %s; used here: %s",
        find_varlen_attn() is not None,
        backend.can_use_varlen(q.to(CUDA, dtype), window),
    )
    scale = head_dim**-0.5
    ours = backend.attend(
        q.to(CUDA, dtype),
        k.to(CUDA, dtype),
        v.to(CUDA, dtype),
        layer=0,
        meta=gpu_meta,
        kv_cache=gpu_cache,
        sliding_window=window,
        scale=scale,
    )
    reference = ReferenceAttention().attend(
        q, k, v, layer=0, meta=cpu_meta, kv_cache=cpu_cache, sliding_window=window, scale=scale
    )
    rel = 2e-2 if dtype == torch.bfloat16 else 1e-4
    diff = (ours.float().cpu() - reference).abs().max().item()
    assert diff <= rel * reference.abs().max().item(), diff
    for gpu_t, cpu_t in zip(gpu_cache.key_caches, cpu_cache.key_caches, strict=True):
        assert torch.equal(gpu_t.float().cpu(), cpu_t)


def test_varlen_kernel_is_used_for_bf16_when_available() -> None:
    if find_varlen_attn() is None:
        pytest.skip("this torch has no torch.nn.attention.varlen.varlen_attn")
    query = torch.zeros(4, 8, 64, device=CUDA, dtype=torch.bfloat16)
    assert CudaAttention().can_use_varlen(query, None)
