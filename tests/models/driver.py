"""Test-only drivers: pack whole prompts, or split them into chunks over a paged KV cache."""

from __future__ import annotations

import random
from dataclasses import dataclass

import torch

from poolserve.models import LoadedModel, PagedKVCache, build_attention_metadata

PROMPT_LENGTHS = (1, 5, 37, 130, 300)
SHORT_PROMPT_LENGTHS = (1, 5, 37)
BLOCK_SIZE = 16


def make_prompts(lengths: tuple[int, ...], seed: int = 0) -> list[list[int]]:
    """Random token ids away from the special tokens (no padding id anywhere)."""
    rng = random.Random(seed)
    return [[rng.randrange(1000, 30000) for _ in range(n)] for n in lengths]


def run_whole(
    loaded: LoadedModel, prompts: list[list[int]], device: torch.device
) -> list[torch.Tensor]:
    """Every prompt whole, packed into one forward without a cache."""
    meta = build_attention_metadata(
        seq_lens_q=[len(p) for p in prompts],
        context_lens=[0] * len(prompts),
        write_kv=[False] * len(prompts),
        block_tables=[[] for _ in prompts],
        block_size=BLOCK_SIZE,
        device=device,
        causal=loaded.spec.is_causal,
    )
    ids = torch.tensor([t for p in prompts for t in p], dtype=torch.int64)
    positions = torch.cat([torch.arange(len(p)) for p in prompts])
    hidden = loaded.model(ids.to(device), positions.to(device), meta, None)
    return list(hidden.float().cpu().split([len(p) for p in prompts]))


@dataclass(frozen=True)
class Chunk:
    """One sequence's slice in one forward."""

    prompt: int
    start: int
    stop: int


def _plan_steps(lengths: list[int], chunk_size: int, max_seqs: int) -> list[list[Chunk]]:
    """Round-robin steps of at most max_seqs chunks, so chunks of many prompts interleave."""
    done = [0] * len(lengths)
    steps: list[list[Chunk]] = []
    turn = 0
    while any(d < n for d, n in zip(done, lengths, strict=True)):
        active = [i for i, (d, n) in enumerate(zip(done, lengths, strict=True)) if d < n]
        chosen = [active[(turn + k) % len(active)] for k in range(min(max_seqs, len(active)))]
        turn += 1
        step = []
        for i in chosen:
            stop = min(done[i] + chunk_size, lengths[i])
            step.append(Chunk(i, done[i], stop))
            done[i] = stop
        steps.append(step)
    return steps


def _block_tables(lengths: list[int], seed: int) -> tuple[list[list[int]], int]:
    """Shuffled, non-contiguous block ids per prompt, enough for every token."""
    needed = [-(-n // BLOCK_SIZE) for n in lengths]
    ids = list(range(sum(needed)))
    random.Random(seed).shuffle(ids)
    tables, first = [], 0
    for count in needed:
        tables.append(ids[first : first + count])
        first += count
    return tables, max(len(ids), 1)


def run_chunked(
    loaded: LoadedModel,
    prompts: list[list[int]],
    chunk_size: int,
    device: torch.device,
    max_seqs: int = 3,
) -> list[torch.Tensor]:
    """Every prompt in chunks of chunk_size, several prompts' chunks per forward."""
    lengths = [len(p) for p in prompts]
    tables, num_blocks = _block_tables(lengths, seed=chunk_size)
    spec = loaded.spec
    cache = PagedKVCache(spec, num_blocks, BLOCK_SIZE, device, spec.dtype)
    pieces: list[list[torch.Tensor]] = [[] for _ in prompts]
    for step in _plan_steps(lengths, chunk_size, max_seqs):
        meta = build_attention_metadata(
            seq_lens_q=[c.stop - c.start for c in step],
            context_lens=[c.start for c in step],
            write_kv=[c.stop < lengths[c.prompt] for c in step],
            block_tables=[tables[c.prompt] for c in step],
            block_size=BLOCK_SIZE,
            device=device,
            causal=spec.is_causal,
        )
        ids = torch.tensor([t for c in step for t in prompts[c.prompt][c.start : c.stop]])
        positions = torch.cat([torch.arange(c.start, c.stop) for c in step])
        hidden = loaded.model(ids.to(device), positions.to(device), meta, cache)
        for c, part in zip(step, hidden.float().cpu().split(meta.seq_lens_q), strict=True):
            pieces[c.prompt].append(part)
    return [torch.cat(parts) for parts in pieces]


def assert_close(actual: torch.Tensor, reference: torch.Tensor, rel: float = 1e-4) -> None:
    """Max abs diff <= rel x the reference's max magnitude."""
    assert actual.shape == reference.shape, (actual.shape, reference.shape)
    scale = reference.abs().max().item()
    diff = (actual.float() - reference.float()).abs().max().item()
    assert diff <= rel * max(scale, 1e-12), f"max abs diff {diff} > {rel} x {scale}"
