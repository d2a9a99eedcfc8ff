"""SPLADE sparse pooling equals a dense reference, for any chunking, batching and row blocking."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from poolserve.engine.bridge import pooling_info_from
from poolserve.models import LoadedModel, build_attention_metadata, load_model
from poolserve.pooling import (
    CloneStats,
    InvalidPoolingParamsError,
    PoolingConfigError,
    PoolingModelInfo,
    PoolingParams,
    PoolingTask,
    UnsupportedTaskError,
    build_pooler,
    get_supported_tasks,
    pool_step,
)
from poolserve.pooling import sparse as pooling_sparse
from poolserve.pooling.pooler import ChunkInput
from poolserve.pooling.sparse import kept_runs
from tests.pooling.util import CHUNK_SIZES, SimRequest, assert_close, feed_chunked, run_steps
from tests.tiny_encoders import build_hf_encoder, save_tiny_encoder
from tests.tiny_models import SPECIAL_TOKENS

T = PoolingTask
HIDDEN = 16
VOCAB = 50
EXCLUDED = frozenset({0, 1, 2})
SPARSE = PoolingParams(task=T.EMBED_SPARSE)
CPU = torch.device("cpu")
MLM_FIXTURES = ("bert_mlm", "distilbert_mlm", "roberta_mlm")


def _head(seed: int = 0) -> nn.Module:
    """A random MLM-shaped head: dense, GELU, LayerNorm, decoder `[..., HIDDEN] -> [..., VOCAB]`."""
    torch.manual_seed(seed)
    head = nn.Sequential(
        nn.Linear(HIDDEN, HIDDEN), nn.GELU(), nn.LayerNorm(HIDDEN), nn.Linear(HIDDEN, VOCAB)
    )
    return head.eval().requires_grad_(False)


def _info(head: nn.Module, excluded: frozenset[int] = EXCLUDED) -> PoolingModelInfo:
    return PoolingModelInfo(
        is_decoder=False, hidden_size=HIDDEN, mlm_head=head, sparse_excluded_ids=excluded
    )


def _prompt(num_tokens: int, seed: int) -> tuple[torch.Tensor, list[int]]:
    gen = torch.Generator().manual_seed(seed)
    hidden = torch.randn(num_tokens, HIDDEN, generator=gen)
    ids = torch.randint(0, 8, (num_tokens,), generator=gen).tolist()  # ids 0-2 are excluded
    return hidden, ids


@torch.no_grad()
def _naive(logits: torch.Tensor, ids: list[int], excluded: frozenset[int]) -> torch.Tensor:
    """log1p(relu(logits)) max-pooled over the non-excluded tokens, dense `[vocab]`."""
    weights = torch.log1p(torch.relu(logits.float()))  # [T, vocab]
    kept = [i for i, token in enumerate(ids) if token not in excluded]
    if not kept:
        return torch.zeros(weights.shape[1])
    return weights[kept].amax(dim=0)


def _dense(sparse: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """`[2, nnz]` (ids, weights) back to `[vocab]`, checking the sparse form on the way."""
    assert sparse.dtype == torch.float32 and sparse.shape[0] == 2
    ids = sparse[0].long()
    assert torch.equal(ids.float(), sparse[0])  # whole numbers
    assert bool((ids[1:] > ids[:-1]).all())  # ascending, no repeats
    assert bool((sparse[1] > 0).all())  # only non-zero weights travel
    dense = torch.zeros(vocab_size)
    dense[ids] = sparse[1]
    return dense


def test_kept_runs_skip_excluded_positions() -> None:
    excluded = torch.tensor(sorted(EXCLUDED)).numpy()
    assert kept_runs([0, 5, 6, 1, 7, 2], excluded) == [(1, 3), (4, 5)]
    assert kept_runs([5, 6], excluded) == [(0, 2)]
    assert kept_runs([0, 1, 2], excluded) == []


@pytest.mark.parametrize("async_scheduling", [False, True])
@pytest.mark.parametrize("chunk_size", CHUNK_SIZES)
def test_sparse_equals_naive_for_any_chunking(
    chunk_size: int | None, async_scheduling: bool
) -> None:
    head, (hidden, ids) = _head(), _prompt(150, seed=3)
    stats = CloneStats()
    pooler = build_pooler(_info(head), SPARSE, async_scheduling=async_scheduling, stats=stats)
    out = feed_chunked(pooler, hidden, ids, chunk_size, async_scheduling)
    assert_close(_dense(out, VOCAB), _naive(head(hidden), ids, EXCLUDED))
    assert stats.num_clones == 0 and stats.num_open_poolers == 0  # a fresh reduction, no views


def test_logits_are_computed_in_bounded_row_blocks(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[int] = []

    class Recording(nn.Module):
        def __init__(self, inner: nn.Module) -> None:
            super().__init__()
            self.inner = inner

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            calls.append(x.shape[0])
            return self.inner(x)

    monkeypatch.setattr(pooling_sparse, "BLOCK_ELEMENTS", 7 * VOCAB)
    head, (hidden, ids) = _head(1), _prompt(100, seed=4)
    ids[40:80] = [5] * 40  # one long run of kept tokens: several full blocks
    info = _info(Recording(head))
    pooler = build_pooler(info, SPARSE, async_scheduling=False, stats=CloneStats())
    out = feed_chunked(pooler, hidden, ids, None, False)
    assert max(calls) == 7  # never more than BLOCK_ELEMENTS logits at once
    assert sum(calls) == sum(token not in EXCLUDED for token in ids)  # excluded rows never decoded
    assert_close(_dense(out, VOCAB), _naive(head(hidden), ids, EXCLUDED))


def test_only_excluded_tokens_give_an_empty_vector() -> None:
    hidden = torch.randn(3, HIDDEN)
    pooler = build_pooler(_info(_head()), SPARSE, async_scheduling=False, stats=CloneStats())
    out = pooler.add_chunk(hidden, [0, 1, 2], is_last=True)
    assert out is not None and out.shape == (2, 0)


@pytest.mark.parametrize("token_budget", [1, 7, 64, 512])
def test_batched_steps_mixing_sparse_with_other_tasks(token_budget: int) -> None:
    head = _head(2)
    info = _info(head)
    stats = CloneStats()
    requests, expected = [], []
    for index, length in enumerate([1, 5, 23, 64, 90, 3, 41]):
        hidden, ids = _prompt(length, seed=50 + index)
        params = SPARSE if index % 2 == 0 else PoolingParams(task=T.TOKEN_EMBED, normalize=False)
        pooler = build_pooler(info, params, async_scheduling=True, stats=stats)
        requests.append(SimRequest(pooler, hidden, tuple(ids)))
        expected.append(_naive(head(hidden), ids, EXCLUDED) if index % 2 == 0 else hidden)
    outputs = run_steps(requests, token_budget, async_scheduling=True)
    for index, (out, ref) in enumerate(zip(outputs, expected, strict=True)):
        assert_close(_dense(out, VOCAB) if index % 2 == 0 else out, ref)
    assert stats.num_open_poolers == 0


def test_tasks_of_a_masked_lm_and_of_a_model_without_one() -> None:
    assert get_supported_tasks(_info(_head())) == {T.EMBED, T.TOKEN_EMBED, T.EMBED_SPARSE}
    plain = PoolingModelInfo(is_decoder=False, hidden_size=HIDDEN)
    with pytest.raises(UnsupportedTaskError) as caught:
        build_pooler(plain, SPARSE, async_scheduling=False, stats=CloneStats())
    assert caught.value.supported == ("embed", "token_embed")
    assert "embed, token_embed" in str(caught.value)
    with pytest.raises(InvalidPoolingParamsError):
        build_pooler(
            _info(_head()),
            PoolingParams(task=T.EMBED_SPARSE, normalize=True),
            async_scheduling=False,
            stats=CloneStats(),
        )
    with pytest.raises(PoolingConfigError):
        PoolingModelInfo(
            is_decoder=False,
            hidden_size=HIDDEN,
            mlm_head=_head(),
            seq_classifier=nn.Linear(HIDDEN, 2),
            num_labels=2,
        )


# --- end to end: the loaded checkpoint's MLM head against transformers' *ForMaskedLM logits ---


@pytest.fixture(scope="module")
def mlm(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], tuple[Any, LoadedModel]]:
    """name -> (the transformers model, the same checkpoint loaded here), built once."""
    cache: dict[str, tuple[Any, LoadedModel]] = {}

    def get(name: str) -> tuple[Any, LoadedModel]:
        if name not in cache:
            hf = build_hf_encoder(name)
            path: Path = save_tiny_encoder(name, tmp_path_factory.mktemp(name), hf)
            cache[name] = (hf, load_model(str(path), device=CPU))
        return cache[name]

    return get


def _prompts() -> list[list[int]]:
    cls, sep, pad = SPECIAL_TOKENS["[CLS]"], SPECIAL_TOKENS["[SEP]"], SPECIAL_TOKENS["[PAD]"]
    gen = torch.Generator().manual_seed(11)
    words = [torch.randint(1000, 30000, (n,), generator=gen).tolist() for n in (9, 40, 3, 17)]
    return [
        [cls, *words[0], sep],
        [cls, *words[1][:20], sep, *words[1][20:], sep],  # a pair: a special in the middle
        [cls, sep],  # nothing but specials
        [cls, *words[2], SPECIAL_TOKENS["[UNK]"], pad, *words[3], sep],
        [*words[3], cls],
    ]


def _packed_hidden(loaded: LoadedModel, prompts: list[list[int]]) -> torch.Tensor:
    meta = build_attention_metadata(
        seq_lens_q=[len(p) for p in prompts],
        context_lens=[0] * len(prompts),
        write_kv=[False] * len(prompts),
        block_tables=[[] for _ in prompts],
        block_size=16,
        device=CPU,
        causal=False,
    )
    ids = torch.tensor([t for p in prompts for t in p])
    positions = torch.cat([torch.arange(len(p)) for p in prompts])
    return loaded.model(ids, positions, meta, None)  # [num_tokens, hidden]


@pytest.mark.parametrize("name", MLM_FIXTURES)
def test_splade_equals_hf_masked_lm_packed_with_other_prompts(
    name: str, mlm: Callable[[str], tuple[Any, LoadedModel]]
) -> None:
    hf, loaded = mlm(name)
    info = pooling_info_from(loaded)
    specials = frozenset(SPECIAL_TOKENS.values()) - {SPECIAL_TOKENS["[UNK]"]}
    assert info.sparse_excluded_ids == specials  # UNK stands for text: it is pooled
    prompts = _prompts()
    # Every other prompt asks for a dense task, packed into the same step.
    tasks = [T.EMBED_SPARSE, T.EMBED, T.EMBED_SPARSE, T.TOKEN_EMBED, T.EMBED_SPARSE]
    stats = CloneStats()
    poolers = [
        build_pooler(info, PoolingParams(task=task), async_scheduling=True, stats=stats)
        for task in tasks
    ]
    chunks = [ChunkInput(len(p), p, is_last=True) for p in prompts]
    with torch.inference_mode():
        outputs = pool_step(_packed_hidden(loaded, prompts), chunks, poolers)
    vocab_size = hf.config.vocab_size
    for prompt, task, out in zip(prompts, tasks, outputs, strict=True):
        assert out is not None
        if task is not T.EMBED_SPARSE:
            continue
        with torch.no_grad():
            logits = hf(input_ids=torch.tensor([prompt])).logits[0]  # [T, vocab]
        want = _naive(logits, prompt, specials)
        assert_close(_dense(out, vocab_size), want)
        assert out.shape[1] == int((want > 0).sum())  # the same non-zero entries
