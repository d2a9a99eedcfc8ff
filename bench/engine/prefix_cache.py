"""Prefix caching on CPU: a 1 x N rerank on a decoder reranker shape, caching on against off.

Run from the repository root: `python -m bench prefix [--quick] [--repeats N]`. Builds the random
Qwen3-0.6B-shaped decoder of bench/common/models.py (2 layers, float32) and submits one query's
prompts at once: a shared prefix (instruction and query, 256 tokens) then one document (64
tokens), 100 documents, pooled at the last token as a yes/no or score-head reranker reads a
decoder. Every repeat runs caching on and off on fresh engines (a cold cache: each query is new),
alternating which goes first. A control workload with nothing shared shows what caching costs
when it cannot help. Prints markdown tables; asserts nothing.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import random
import statistics
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np
import torch

from bench.common.models import CPU, EMBED, save_decoder
from poolserve.engine.loop import Engine
from poolserve.models.loader import load_model
from poolserve.models.spec import LoadedModel
from poolserve.types.limits import SchedulerConfig

logger = logging.getLogger(__name__)

CONFIG = SchedulerConfig(max_num_batched_tokens=2048, num_kv_blocks=1024)
PREFIX_TOKENS = 256
DOCUMENT_TOKENS = 64
NUM_DOCUMENTS = 100
NUM_LAYERS = 2


@dataclass(frozen=True)
class RunResult:
    """One engine run of one workload."""

    wall_s: float
    cpu_s: float  # this process's CPU time: less swayed than wall time by a shared machine
    num_prompt_tokens: int
    num_computed_tokens: int  # tokens run through the model
    num_steps: int
    num_hit_tokens: int
    outputs: tuple[np.ndarray, ...]

    @property
    def tokens_per_s(self) -> float:
        """Prompt tokens served per wall second (cached ones count: the caller got them)."""
        return self.num_prompt_tokens / self.wall_s


def rerank_prompts(seed: int) -> list[list[int]]:
    """One query's prompts: a shared prefix, then each document."""
    rng = random.Random(seed)
    prefix = [rng.randrange(1000, 30000) for _ in range(PREFIX_TOKENS)]
    return [
        prefix + [rng.randrange(1000, 30000) for _ in range(DOCUMENT_TOKENS)]
        for _ in range(NUM_DOCUMENTS)
    ]


def unshared_prompts(seed: int) -> list[list[int]]:
    """The same lengths with nothing shared."""
    rng = random.Random(seed)
    length = PREFIX_TOKENS + DOCUMENT_TOKENS
    return [[rng.randrange(1000, 30000) for _ in range(length)] for _ in range(NUM_DOCUMENTS)]


async def run_once(
    loaded: LoadedModel, config: SchedulerConfig, prompts: Sequence[list[int]]
) -> RunResult:
    """Warm a fresh engine up on unrelated prompts, then time all prompts submitted at once."""
    engine = Engine(loaded, config, CPU)
    engine.start()
    try:
        warm_up = unshared_prompts(seed=12345)[:4]  # shares nothing with the timed prompts
        await asyncio.gather(*engine.submit_many(warm_up, EMBED))
        steps, tokens = engine.num_steps, engine.step_tokens_total
        hits = engine.blocks.num_hit_tokens
        start, cpu_start = time.perf_counter(), time.process_time()
        outputs = await asyncio.gather(*engine.submit_many(list(prompts), EMBED))
        wall, cpu = time.perf_counter() - start, time.process_time() - cpu_start
    finally:
        await engine.stop()
    return RunResult(
        wall,
        cpu,
        sum(len(p) for p in prompts),
        engine.step_tokens_total - tokens,
        engine.num_steps - steps,
        engine.blocks.num_hit_tokens - hits,
        tuple(o.data for o in outputs),
    )


def max_relative_diff(a: Sequence[np.ndarray], b: Sequence[np.ndarray]) -> float:
    """Largest |a - b| over the reference's scale, across outputs."""
    return max(
        float(np.abs(x - y).max()) / max(float(np.abs(y).max()), 1e-6)
        for x, y in zip(a, b, strict=True)
    )


async def compare(
    loaded: LoadedModel, config: SchedulerConfig, prompts: list[list[int]], repeats: int
) -> dict[bool, list[RunResult]]:
    """Caching on and off, interleaved: each repeat alternates which runs first."""
    runs: dict[bool, list[RunResult]] = {True: [], False: []}
    for repeat in range(repeats):
        for caching in (True, False) if repeat % 2 == 0 else (False, True):
            result = await run_once(loaded, replace(config, enable_prefix_caching=caching), prompts)
            logger.info("repeat %d caching %s: %.2f s", repeat, caching, result.wall_s)
            runs[caching].append(result)
    return runs


def table(name: str, runs: dict[bool, list[RunResult]]) -> str:
    """Markdown rows for one workload: medians over repeats, and the speed-up."""
    lines = []
    base = statistics.median(r.wall_s for r in runs[False])
    base_cpu = statistics.median(r.cpu_s for r in runs[False])
    diff = max_relative_diff(runs[True][0].outputs, runs[False][0].outputs)
    for caching in (False, True):
        rs = runs[caching]
        wall = statistics.median(r.wall_s for r in rs)
        cpu = statistics.median(r.cpu_s for r in rs)
        walls = ", ".join(f"{r.wall_s:.1f}" for r in rs)
        lines.append(
            f"| {name} | {'on' if caching else 'off'} | {rs[0].num_prompt_tokens} | "
            f"{rs[0].num_computed_tokens} | {rs[0].num_hit_tokens} | {rs[0].num_steps} | "
            f"{walls} | {statistics.median(r.tokens_per_s for r in rs):.0f} | "
            f"{base / wall:.2f}x | {cpu:.1f} | {base_cpu / cpu:.2f}x | "
            f"{diff if caching else 0.0:.1e} |"
        )
    return "\n".join(lines)


HEADER = (
    "| workload | prefix caching | prompt tokens | computed tokens | hit tokens | steps "
    "| wall s per repeat | prompt tokens/s (median) | speed-up (wall) | CPU s (median) "
    "| speed-up (CPU) | max rel diff |\n"
    "|---|---|---:|---:|---:|---:|---|---:|---:|---:|---:|---:|"
)


async def run(repeats: int, config: SchedulerConfig) -> str:
    """Both workloads; the markdown table."""
    with tempfile.TemporaryDirectory() as tmp:
        loaded = load_model(str(save_decoder(Path(tmp), NUM_LAYERS)), device=CPU)
    rows = [HEADER]
    shape = f"1 x {NUM_DOCUMENTS} rerank, {PREFIX_TOKENS} shared + {DOCUMENT_TOKENS}"
    rows.append(table(shape, await compare(loaded, config, rerank_prompts(seed=0), repeats)))
    control = f"{NUM_DOCUMENTS} x {PREFIX_TOKENS + DOCUMENT_TOKENS}, nothing shared"
    rows.append(table(control, await compare(loaded, config, unshared_prompts(seed=1), repeats)))
    return "\n".join(rows)


def main() -> None:
    """Parse flags and run."""
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--quick", action="store_true", help="2 repeats instead of 3")
    parser.add_argument("--repeats", type=int, default=None, help="repeats of each mode")
    parser.add_argument(
        "--max-num-batched-tokens",
        type=int,
        default=CONFIG.max_num_batched_tokens,
        help="the step's token budget",
    )
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    repeats = args.repeats or (2 if args.quick else 3)
    config = replace(CONFIG, max_num_batched_tokens=args.max_num_batched_tokens)
    logger.info("torch threads %d, %s", torch.get_num_threads(), config)
    print(
        f"Qwen3-0.6B shape, {NUM_LAYERS} layers, fp32, LAST pooling, "
        f"max_num_batched_tokens {config.max_num_batched_tokens}, block_size "
        f"{config.block_size}, async scheduling on\n"
    )
    print(asyncio.run(run(repeats, config)))


if __name__ == "__main__":
    main()
