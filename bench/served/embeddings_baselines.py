"""Baselines for the served benchmark: the offline engine on the same prompts, the bare forward.

Also the opt-in profiler hook: with BENCH_SERVED_CPROFILE=DIR set, poolserve is started under
cProfile (event-loop thread only) and writes DIR/poolserve-<port>.prof when it exits.
"""

from __future__ import annotations

import asyncio
import gc
import os
import statistics
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from bench.common.models import CPU, EMBED
from poolserve.engine.loop import Engine
from poolserve.models.attention import build_attention_metadata
from poolserve.models.loader import load_model
from poolserve.models.spec import LoadedModel
from poolserve.types.limits import SchedulerConfig

PROFILE_VARIABLE = "BENCH_SERVED_CPROFILE"
FORWARD_REPEATS = 50


@dataclass(frozen=True)
class OfflineResult:
    """Offline engine throughput on the single-input prompts, and the bare short forward."""

    prompts: int
    tokens: int
    wall_s: float
    short_tokens: int
    forward_p50_ms: float
    forward_min_ms: float  # the least contended run: other jobs share these cores

    @property
    def tokens_per_s(self) -> float:
        """Prompt tokens per second, first submit to last result."""
        return self.tokens / self.wall_s


def server_like_config(loaded: LoadedModel) -> SchedulerConfig:
    """The scheduler config `poolserve serve` builds from its default flags."""
    return SchedulerConfig(
        max_num_batched_tokens=4096,
        num_kv_blocks=2048,
        enable_chunked_prefill=loaded.spec.is_causal,
    )


def bare_forward_ms(loaded: LoadedModel, ids: list[int]) -> tuple[float, float]:
    """(median, min) ms of the packed model's forward on one prompt (no scheduler, pooling)."""
    input_ids = torch.tensor(ids, dtype=torch.int64)  # [num_tokens]
    positions = torch.arange(len(ids), dtype=torch.int64)  # [num_tokens]
    meta = build_attention_metadata(
        seq_lens_q=[len(ids)],
        context_lens=[0],
        write_kv=[False],
        block_tables=[[]],
        block_size=16,
        device=CPU,
        causal=loaded.spec.is_causal,
    )
    times = []
    with torch.inference_mode():
        for _ in range(FORWARD_REPEATS + 5):
            start = time.perf_counter()
            loaded.model(input_ids, positions, meta, None)  # [num_tokens, hidden]
            times.append(time.perf_counter() - start)
    return statistics.median(times[5:]) * 1e3, min(times[5:]) * 1e3


async def engine_throughput(loaded: LoadedModel, prompts: list[list[int]]) -> float:
    """Wall seconds for the engine to embed every prompt submitted at once (after a warm-up)."""
    engine = Engine(loaded, server_like_config(loaded), CPU)
    engine.start()
    try:
        await asyncio.gather(*engine.submit_many(prompts[:4], EMBED))
        start = time.perf_counter()
        await asyncio.gather(*engine.submit_many(prompts, EMBED))
        return time.perf_counter() - start
    finally:
        await engine.stop()


async def measure(model_dir: Path, texts: Sequence[str], short_text: str) -> OfflineResult:
    """Load the model in this process, measure, and free it before the servers start."""
    loaded = load_model(str(model_dir), device=CPU, dtype=torch.float32)
    prompts = [
        list(ids) for ids in loaded.tokenizer(list(texts), add_special_tokens=True)["input_ids"]
    ]
    short = list(loaded.tokenizer(short_text, add_special_tokens=True)["input_ids"])
    forward_p50, forward_min = bare_forward_ms(loaded, short)
    wall = await engine_throughput(loaded, prompts)
    result = OfflineResult(
        len(prompts), sum(len(p) for p in prompts), wall, len(short), forward_p50, forward_min
    )
    del loaded
    gc.collect()
    return result


def profile_prefix(server_name: str, port: int) -> list[str]:
    """Arguments that run poolserve under cProfile when the profiling variable is set."""
    directory = os.environ.get(PROFILE_VARIABLE)
    if not directory or server_name != "poolserve":
        return []
    out = Path(directory) / f"poolserve-{port}-{int(time.time())}.prof"
    return ["-m", "cProfile", "-o", str(out)]
