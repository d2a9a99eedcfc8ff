"""Chunked prefill over the paged KV cache equals whole prompts and the HF reference."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

from poolserve.models import LoadedModel, PagedKVCache, build_attention_metadata
from tests.models.driver import (
    SHORT_PROMPT_LENGTHS,
    assert_close,
    make_prompts,
    run_chunked,
)

CPU = torch.device("cpu")
DECODERS = (
    "llama",
    "mistral",
    "qwen2",
    "qwen3",
    "qwen3_base",
    "llama_cls1",
    "llama_cls3",
    "qwen2_tokcls",
    "qwen2_prm",
    "qwen2_rm",
)


CORE_FAMILIES = ("llama", "mistral", "qwen2", "qwen3")
# Chunks of 7 are slow on 300-token prompts: run them on one checkpoint per family only.
CASES = [(name, size) for name in DECODERS for size in (64, 10_000)] + [
    (name, 7) for name in CORE_FAMILIES
]


@pytest.mark.parametrize(("name", "chunk_size"), CASES)
def test_chunked_equals_hf(
    name: str,
    chunk_size: int,
    loaded_tiny: Callable[[str], LoadedModel],
    hf_hidden: Callable[[str], list[torch.Tensor]],
    prompts: list[list[int]],
) -> None:
    outputs = run_chunked(loaded_tiny(name), prompts, chunk_size, CPU)
    for ours, reference in zip(outputs, hf_hidden(name), strict=True):
        assert_close(ours, reference)


@pytest.mark.parametrize("name", CORE_FAMILIES)
def test_chunk_size_one_on_short_prompts(
    name: str,
    loaded_tiny: Callable[[str], LoadedModel],
    hf_hidden: Callable[[str], list[torch.Tensor]],
) -> None:
    # The session prompts start with these lengths and the same seed's tokens.
    short = make_prompts(SHORT_PROMPT_LENGTHS)
    outputs = run_chunked(loaded_tiny(name), short, 1, CPU, max_seqs=2)
    for ours, reference in zip(outputs, hf_hidden(name), strict=False):
        assert_close(ours, reference)


def test_whole_prompt_never_writes_the_cache(loaded_tiny: Callable[[str], LoadedModel]) -> None:
    loaded = loaded_tiny("mistral")
    cache = PagedKVCache(loaded.spec, num_blocks=8, block_size=16, device=CPU, dtype=torch.float32)
    for tensor in cache.key_caches + cache.value_caches:
        tensor.fill_(7.0)
    meta = build_attention_metadata(
        seq_lens_q=[20, 30],
        context_lens=[0, 0],
        write_kv=[False, False],
        block_tables=[[0, 1], [2, 3]],
        block_size=16,
        device=CPU,
        causal=True,
    )
    ids = torch.randint(1000, 2000, (50,))
    positions = torch.cat([torch.arange(20), torch.arange(30)])
    loaded.model(ids, positions, meta, cache)
    assert all(bool((t == 7.0).all()) for t in cache.key_caches + cache.value_caches)


def test_continuing_chunk_writes_only_its_slots(loaded_tiny: Callable[[str], LoadedModel]) -> None:
    loaded = loaded_tiny("qwen3")
    cache = PagedKVCache(loaded.spec, num_blocks=8, block_size=16, device=CPU, dtype=torch.float32)
    for tensor in cache.key_caches:
        tensor.fill_(7.0)
    # 20 new tokens at positions 0..19 through blocks [5, 2]: block 5 fully, block 2 slots 0..3.
    meta = build_attention_metadata(
        seq_lens_q=[20],
        context_lens=[0],
        write_kv=[True],
        block_tables=[[5, 2, 6]],
        block_size=16,
        device=CPU,
        causal=True,
    )
    loaded.model(torch.randint(1000, 2000, (20,)), torch.arange(20), meta, cache)
    for keys in cache.key_caches:
        written = (keys != 7.0).flatten(2).any(-1)  # [num_blocks, block_size]
        expected = torch.zeros_like(written)
        expected[5] = True
        expected[2, :4] = True
        assert torch.equal(written, expected)


def test_metadata_refuses_chunked_encoder_and_short_tables() -> None:
    with pytest.raises(ValueError, match="encoder"):
        build_attention_metadata(
            seq_lens_q=[4],
            context_lens=[4],
            write_kv=[False],
            block_tables=[[0]],
            block_size=16,
            device=CPU,
            causal=False,
        )
    with pytest.raises(ValueError, match="block table"):
        build_attention_metadata(
            seq_lens_q=[20],
            context_lens=[0],
            write_kv=[True],
            block_tables=[[0]],
            block_size=16,
            device=CPU,
            causal=True,
        )
