"""Static embeddings on the CPU: poolserve's offline engine vs model2vec's encode, same corpus.

Run from the repository root: `python -m bench static [--quick]`. One model2vec model the size of
minishlab/potion-base-8M (MiniLM's 30,522-token WordPiece vocabulary x 256, random rows, saved by
model2vec itself) embeds the corpus texts (bench/common/corpus.py, up to 256 tokens each) with
both, in this process, taking turns; each row keeps its fastest pass. MiniLM (a 6-layer
transformer) through the same engine on a slice of the texts gives the cost a static model saves.
Prints markdown; asserts nothing (the outputs' agreement is printed, not checked).
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

import numpy as np
from tokenizers import Tokenizer

from bench.common.corpus import build_texts
from bench.common.timing import fastest
from poolserve.offline import PoolingEngine
from tests.tiny_models import minilm_path

DIM = 256  # potion-base-8M's width
SIZES = {"quick": (2_000, 200, 2), "full": (10_000, 300, 3)}  # texts, MiniLM texts, passes
BATCH = 2_048  # inputs per embed call: --max-client-batch-size's default


def _save_model(directory: Path) -> Path:
    """A potion-base-8M-sized model2vec model with random rows, saved by model2vec."""
    from model2vec import StaticModel

    tokenizer = Tokenizer.from_file(str(minilm_path() / "tokenizer.json"))
    rows = np.random.default_rng(0).standard_normal((tokenizer.get_vocab_size(), DIM))
    StaticModel(rows.astype(np.float32), tokenizer, normalize=True).save_pretrained(directory)
    return directory


def _engine_embed(engine: PoolingEngine, texts: list[str]) -> np.ndarray:
    return np.concatenate(
        [engine.embed_array(texts[i : i + BATCH]) for i in range(0, len(texts), BATCH)]
    )


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m bench static", description=__doc__)
    parser.add_argument("--quick", action="store_true", help="fewer texts and passes")
    args = parser.parse_args(argv)
    num_texts, num_minilm, passes = SIZES["quick" if args.quick else "full"]
    from model2vec import StaticModel

    texts = build_texts(minilm_path(), num_texts, seed=0, max_length=256).texts
    num_chars = sum(len(text) for text in texts)
    with tempfile.TemporaryDirectory() as tmp:
        directory = _save_model(Path(tmp))
        reference = StaticModel.from_pretrained(directory)
        with PoolingEngine(str(directory)) as engine:
            _engine_embed(engine, texts[:BATCH])  # warm
            ours, got = fastest(lambda: _engine_embed(engine, texts), passes)
            theirs, want = fastest(lambda: reference.encode(texts), passes)
        with PoolingEngine(str(minilm_path())) as minilm:
            slice_s, _ = fastest(lambda: _engine_embed(minilm, texts[:num_minilm]), 1)
    minilm_rate = num_minilm / slice_s
    print(f"{num_texts} texts, {num_chars / num_texts:.0f} characters each on average\n")
    print("| runtime | texts/s | vs model2vec |")
    print("|---|---:|---:|")
    print(f"| model2vec {_version()} `StaticModel.encode` | {num_texts / theirs:,.0f} | 1.00x |")
    print(f"| poolserve offline engine | {num_texts / ours:,.0f} | {theirs / ours:.2f}x |")
    ratio = minilm_rate * theirs / num_texts
    print(f"| poolserve, MiniLM-L6 (transformer) | {minilm_rate:,.0f} | {ratio:.4f}x |")
    print(f"\nmax |poolserve - model2vec| = {float(np.abs(got - want).max()):.1e}")


def _version() -> str:
    from importlib.metadata import version

    return version("model2vec")


if __name__ == "__main__":
    main()
