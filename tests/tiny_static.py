"""Tiny static embedding checkpoints (model2vec, sentence-transformers StaticEmbedding) for tests.

Random tables over MiniLM's real WordPiece tokenizer (its [UNK] is what model2vec drops), saved
by the reference libraries themselves.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
from tokenizers import Tokenizer

from tests.tiny_models import minilm_path

DIM = 16
# Texts with known words, unknown ones (the emoji is [UNK] to MiniLM's vocabulary), only unknown
# ones, upper case, punctuation, and one longer than model2vec's 512-token cut.
TEXTS = (
    "hello world",
    "An emoji \U0001f916 between words, and \u4e2d\u6587 too.",
    "\U0001f916",
    "Static embeddings: no transformer at all!",
    "the quick brown fox jumps over the lazy dog " * 80,
    "a",
)


def minilm_tokenizer() -> Tokenizer:
    """MiniLM's tokenizer.json as the `tokenizers` object model2vec and StaticEmbedding take."""
    return Tokenizer.from_file(str(minilm_path() / "tokenizer.json"))


def random_table(num_rows: int, seed: int = 0) -> np.ndarray:
    """A random float32 table [num_rows, DIM]."""
    return np.random.default_rng(seed).standard_normal((num_rows, DIM)).astype(np.float32)


def save_model2vec(directory: Path, *, seed: int = 0, **options: object) -> Path:
    """A model2vec StaticModel saved by model2vec (options: normalize, max_length, weights...)."""
    from model2vec import StaticModel

    tokenizer = minilm_tokenizer()
    rows = options.pop("num_rows", tokenizer.get_vocab_size())
    assert isinstance(rows, int)
    StaticModel(random_table(rows, seed), tokenizer, **options).save_pretrained(directory)  # type: ignore[arg-type]
    return directory


def save_static_embedding(directory: Path, *, normalize: bool, seed: int = 0) -> Path:
    """A sentence-transformers model of one StaticEmbedding (and a Normalize), saved by it."""
    from sentence_transformers import SentenceTransformer
    from sentence_transformers.sentence_transformer.modules import Normalize, StaticEmbedding

    tokenizer = minilm_tokenizer()
    static = StaticEmbedding(
        tokenizer, embedding_weights=random_table(tokenizer.get_vocab_size(), seed)
    )
    modules = [static, Normalize()] if normalize else [static]
    SentenceTransformer(modules=modules, device="cpu").save(str(directory))
    return directory


def exact_model2vec(directory: Path) -> Any:
    """model2vec's StaticModel of a saved folder, averaging in float64.

    Its encode() sums a prompt's rows one after another in the table's float32 (numpy's mean
    along a strided axis): 1.2e-6 off the exact mean of 512 rows, where poolserve's float64
    sum rounded to float32 is within 6e-8. In float64 its tokenization, unknown-token drop and
    cut are the same.
    """
    from model2vec import StaticModel

    model = StaticModel.from_pretrained(directory)
    model.embedding = model.embedding.astype(np.float64)
    return model
