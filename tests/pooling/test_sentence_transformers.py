"""sentence-transformers configs: the real MiniLM, a Dense projection and Matryoshka truncation."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from sentence_transformers import SentenceTransformer
from sentence_transformers.sentence_transformer.modules import Dense, Normalize
from torch import nn

from poolserve.pooling import CloneStats, PoolingModelInfo, PoolingParams, PoolingTask, build_pooler
from tests.pooling.util import CHUNK_SIZES, assert_close, feed_chunked

SENTENCES = (
    "A man is eating food.",
    "The quick brown fox jumps over the lazy dog, twice, while nobody is watching it.",
    "Pooling across chunks must not change the embedding.",
)
DENSE_OUT = 32


@pytest.fixture(scope="module")
def minilm(minilm_dir: Path) -> SentenceTransformer:
    return SentenceTransformer(str(minilm_dir), device="cpu")


@pytest.fixture(scope="module")
def minilm_dense(minilm: SentenceTransformer) -> tuple[SentenceTransformer, Dense]:
    """MiniLM with an extra Dense(384 -> 32, tanh) before Normalize, as some ST models ship."""
    torch.manual_seed(1)
    pooling: Any = minilm[1]
    dense = Dense(pooling.get_embedding_dimension(), DENSE_OUT, activation_function=nn.Tanh())
    model = SentenceTransformer(modules=[minilm[0], minilm[1], dense, Normalize()], device="cpu")
    return model, dense


@torch.no_grad()
def _hidden_states(model: SentenceTransformer, text: str) -> tuple[torch.Tensor, list[int]]:
    """HF BertModel last hidden states `[num_tokens, 384]` for one unpadded sentence."""
    ids: list[int] = model.tokenizer(text)["input_ids"]
    bert: Any = model[0].auto_model
    hidden = bert(input_ids=torch.tensor([ids])).last_hidden_state[0]
    return hidden, ids


def _embed(
    info: PoolingModelInfo,
    params: PoolingParams,
    hidden: torch.Tensor,
    ids: list[int],
    chunk: int | None,
) -> torch.Tensor:
    pooler = build_pooler(info, params, async_scheduling=True, stats=CloneStats())
    return feed_chunked(pooler, hidden, ids, chunk, async_scheduling=True)


@pytest.mark.parametrize("chunk_size", CHUNK_SIZES)
def test_minilm_mean_normalize_matches_sentence_transformers(
    minilm: SentenceTransformer, chunk_size: int | None
) -> None:
    expected = minilm.encode(list(SENTENCES), convert_to_tensor=True)  # [3, 384]
    info = PoolingModelInfo(is_decoder=False, hidden_size=384, st_pooling_mode="mean")
    for text, reference in zip(SENTENCES, expected, strict=True):
        hidden, ids = _hidden_states(minilm, text)
        assert_close(
            _embed(info, PoolingParams(PoolingTask.EMBED), hidden, ids, chunk_size), reference
        )


def _dense_info(dense: Dense) -> PoolingModelInfo:
    # The ST Dense module reads a features dict; pooling takes the same layers as tensor -> tensor.
    projection = nn.Sequential(dense.linear, nn.Tanh())
    assert isinstance(dense.activation_function, nn.Tanh)
    return PoolingModelInfo(
        is_decoder=False,
        hidden_size=384,
        st_pooling_mode="mean",
        embed_projection=projection,
        embed_output_size=DENSE_OUT,
        supports_matryoshka=True,
    )


@pytest.mark.parametrize("chunk_size", CHUNK_SIZES)
def test_dense_projection_matches_sentence_transformers(
    minilm_dense: tuple[SentenceTransformer, Dense], chunk_size: int | None
) -> None:
    model, dense = minilm_dense
    expected = model.encode(list(SENTENCES), convert_to_tensor=True)  # [3, 32]
    for text, reference in zip(SENTENCES, expected, strict=True):
        hidden, ids = _hidden_states(model, text)
        out = _embed(_dense_info(dense), PoolingParams(PoolingTask.EMBED), hidden, ids, chunk_size)
        assert_close(out, reference)


@pytest.mark.parametrize("dimensions", [8, 16, DENSE_OUT])
def test_matryoshka_matches_truncated_sentence_transformers(
    minilm_dense: tuple[SentenceTransformer, Dense], dimensions: int
) -> None:
    model, dense = minilm_dense
    # ST truncates its normalized output; renormalizing it is truncate-then-normalize.
    truncated = model.encode(list(SENTENCES), convert_to_tensor=True, truncate_dim=dimensions)
    expected = F.normalize(truncated, dim=-1)
    params = PoolingParams(PoolingTask.EMBED, dimensions=dimensions)
    for text, reference in zip(SENTENCES, expected, strict=True):
        hidden, ids = _hidden_states(model, text)
        assert_close(_embed(_dense_info(dense), params, hidden, ids, 7), reference)
