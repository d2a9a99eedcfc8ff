"""Length-bucketed CPU attention: equal to the per-sequence reference, and routed where it must."""

from __future__ import annotations

import random
from collections.abc import Callable

import pytest
import torch

from poolserve.models import AttentionMetadata, PagedKVCache, build_attention_metadata
from poolserve.models.attention import select_attention_backend
from poolserve.models.attention_buckets import MAX_BUCKET_LEN
from poolserve.models.attention_cpu import BucketedAttention, ReferenceAttention
from poolserve.models.spec import HeadKind, ModelSpec
from tests.models.driver import assert_close

CPU = torch.device("cpu")
HEAD_DIM, BLOCK = 8, 8


def _meta(
    lens: list[int],
    causal: bool,
    context: list[int] | None = None,
    tables: list[list[int]] | None = None,
) -> AttentionMetadata:
    context = context or [0] * len(lens)
    return build_attention_metadata(
        seq_lens_q=lens,
        context_lens=context,
        write_kv=[c > 0 for c in context],
        block_tables=tables or [[] for _ in lens],
        block_size=BLOCK,
        device=CPU,
        causal=causal,
    )


def _qkv(num_tokens: int, heads: int, kv_heads: int, seed: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return [
        torch.randn(num_tokens, h, HEAD_DIM, generator=gen) for h in (heads, kv_heads, kv_heads)
    ]


def _lengths(rng: random.Random) -> list[int]:
    """A step's mix: short and long prompts, 1..512 tokens, with repeated lengths (buckets)."""
    pool = [rng.choice([rng.randint(1, 24), rng.randint(1, 512)]) for _ in range(rng.randint(1, 8))]
    return [rng.choice(pool) for _ in range(rng.randint(1, 16))]


def _both(
    meta: AttentionMetadata, qkv: list[torch.Tensor], **options: object
) -> tuple[torch.Tensor, torch.Tensor]:
    """(bucketed, reference) outputs of one layer call."""
    kwargs: dict[str, object] = {"layer": 0, "meta": meta, "kv_cache": None, "scale": 0.3}
    kwargs.update({"sliding_window": None, **options})
    return (
        BucketedAttention().attend(*qkv, **kwargs),  # type: ignore[arg-type]
        ReferenceAttention().attend(*qkv, **kwargs),  # type: ignore[arg-type]
    )


@pytest.mark.parametrize("seed", range(24))
def test_buckets_match_reference_on_random_length_mixes(seed: int) -> None:
    rng = random.Random(seed)
    lens = _lengths(rng)
    causal = seed % 2 == 0
    window = [None, None, 3, 40, 200][seed % 5]
    heads, kv_heads = rng.choice([(4, 4), (4, 2), (6, 1)])
    meta = _meta(lens, causal)
    assert meta.buckets is not None
    bucketed, reference = _both(meta, _qkv(sum(lens), heads, kv_heads, seed), sliding_window=window)
    assert_close(bucketed, reference, rel=1e-5)


def test_layout_covers_every_sequence_once_in_equal_length_buckets() -> None:
    rng = random.Random(7)
    for _ in range(50):
        lens = _lengths(rng)
        context = [rng.choice([0, 0, 5]) for _ in lens]
        tables = [list(range(i * 80, (i + 1) * 80)) for i in range(len(lens))]
        meta = _meta(lens, True, context, tables)
        layout = meta.buckets
        assert layout is not None
        members = [i for b in layout.buckets for i in b.seq_ids]
        assert sorted(members + list(layout.single)) == list(range(len(lens)))
        for bucket in layout.buckets:
            assert bucket.num_seqs > 1
            assert all(lens[i] == bucket.seq_len and context[i] == 0 for i in bucket.seq_ids)
            tokens = [meta.query_starts[i] + t for i in bucket.seq_ids for t in range(lens[i])]
            assert bucket.token_index.tolist() == tokens
            assert bucket.seq_len <= MAX_BUCKET_LEN
        # alone: cached context, too long to gain, or no other context-free prompt of its length
        free = [lens[i] for i in range(len(lens)) if context[i] == 0]
        assert all(
            context[i] or lens[i] > MAX_BUCKET_LEN or free.count(lens[i]) == 1
            for i in layout.single
        )


def test_short_equal_lengths_share_one_call_and_the_rest_stay_alone() -> None:
    layout = _meta([3, 64, 3, 500, 1, 300, 500, 3, 20, 20], causal=False).buckets
    assert layout is not None
    assert [(b.seq_ids, b.seq_len) for b in layout.buckets] == [((0, 2, 7), 3), ((8, 9), 20)]
    assert layout.single == (1, 3, 4, 5, 6)


def _calls(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Counts batched bucket calls."""
    import poolserve.models.attention_cpu as cpu

    calls: list[int] = []
    original = cpu._attend_bucket

    def counted(*args: object, **kwargs: object) -> None:
        calls.append(1)
        original(*args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(cpu, "_attend_bucket", counted)
    return calls


@pytest.mark.parametrize("causal", [False, True])
def test_score_bias_takes_the_reference_path(monkeypatch: pytest.MonkeyPatch, causal: bool) -> None:
    lens = [5, 9, 9, 30]
    meta = _meta(lens, causal)
    calls = _calls(monkeypatch)
    gen = torch.Generator().manual_seed(3)
    biases = {
        (meta.query_starts[i], meta.query_starts[i] + n): torch.randn(4, n, n, generator=gen)
        for i, n in enumerate(lens)
    }
    bias: Callable[[int, int], torch.Tensor] = lambda start, stop: biases[(start, stop)]  # noqa: E731
    bucketed, reference = _both(meta, _qkv(sum(lens), 4, 4, 0), bias=bias)
    assert calls == []
    assert torch.equal(bucketed, reference)


def test_softcap_takes_the_reference_path(monkeypatch: pytest.MonkeyPatch) -> None:
    lens = [5, 9, 9, 30]
    calls = _calls(monkeypatch)
    bucketed, reference = _both(_meta(lens, True), _qkv(sum(lens), 4, 2, 0), softcap=5.0)
    assert calls == []
    assert torch.equal(bucketed, reference)


def _spec(heads: int, kv_heads: int) -> ModelSpec:
    return ModelSpec(
        architecture="test",
        family="test",
        is_causal=True,
        hidden_size=heads * HEAD_DIM,
        vocab_size=10,
        num_layers=1,
        num_kv_heads=kv_heads,
        head_dim=HEAD_DIM,
        max_model_len=1024,
        dtype=torch.float32,
        head_kind=HeadKind.NONE,
        num_labels=None,
        labels=(),
        supports_matryoshka=False,
        matryoshka_dimensions=None,
    )


@pytest.mark.parametrize("window", [None, 7])
def test_chunked_sequences_stay_alone_and_kv_writes_match(
    monkeypatch: pytest.MonkeyPatch, window: int | None
) -> None:
    lens, context = [12, 12, 3, 40, 40, 6], [0, 0, 0, 21, 0, 9]
    needed = [-(-(c + n) // BLOCK) for c, n in zip(context, lens, strict=True)]
    tables = [list(range(sum(needed[:i]), sum(needed[: i + 1]))) for i in range(len(lens))]
    meta = build_attention_metadata(
        seq_lens_q=lens,
        context_lens=context,
        write_kv=[True, False, True, True, False, True],
        block_tables=tables,
        block_size=BLOCK,
        device=CPU,
        causal=True,
    )
    assert meta.buckets is not None and set(meta.buckets.single) >= {3, 5}
    calls = _calls(monkeypatch)
    qkv = _qkv(sum(lens), 4, 2, 1)
    gen = torch.Generator().manual_seed(2)
    caches = [PagedKVCache(_spec(4, 2), sum(needed), BLOCK, CPU, torch.float32) for _ in range(2)]
    for tensors in zip(*(c.key_caches + c.value_caches for c in caches), strict=True):
        noise = torch.randn(tensors[0].shape, generator=gen)
        for tensor in tensors:
            tensor.copy_(noise)
    options = {"layer": 0, "meta": meta, "sliding_window": window, "scale": 0.3}
    bucketed = BucketedAttention().attend(*qkv, kv_cache=caches[0], **options)  # type: ignore[arg-type]
    reference = ReferenceAttention().attend(*qkv, kv_cache=caches[1], **options)  # type: ignore[arg-type]
    assert calls, "the sequences without context should share a bucket"
    assert_close(bucketed, reference, rel=1e-5)
    for ours, theirs in zip(
        caches[0].key_caches + caches[0].value_caches,
        caches[1].key_caches + caches[1].value_caches,
        strict=True,
    ):
        assert torch.equal(ours, theirs)


def test_one_sequence_or_all_distinct_lengths_need_no_bucket() -> None:
    for lens in ([7], [500, 300, 100]):
        layout = _meta(lens, False).buckets
        assert layout is not None and layout.buckets == ()
        assert layout.single == tuple(range(len(lens)))


def test_cpu_selects_the_bucketed_backend() -> None:
    assert isinstance(select_attention_backend(CPU), BucketedAttention)
