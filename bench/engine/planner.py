"""Micro-benchmark of the pure planner: time per plan_step call for queued workloads.

Run from the repository root: `python -m bench planner`. Prints a table; asserts nothing.
"""

from __future__ import annotations

import random
import statistics
import time
from dataclasses import dataclass

from poolserve.engine.sched.planner import PlannerSeq, blocks_needed, plan_step
from poolserve.types.limits import SchedulerConfig


@dataclass(frozen=True)
class Scenario:
    """One row of the table."""

    name: str
    config: SchedulerConfig
    num_waiting: int
    num_running: int
    max_prompt_tokens: int


def _queues(scenario: Scenario, rng: random.Random) -> tuple[list[PlannerSeq], list[PlannerSeq]]:
    """Random waiting and partially prefilled queues (shuffled, so the sort does real work)."""
    config = scenario.config
    running = []
    for rid in range(scenario.num_running):
        prompt = rng.randint(config.max_num_batched_tokens + 1, 8 * config.max_num_batched_tokens)
        running.append(
            PlannerSeq(
                rid,
                prompt,
                rng.randint(1, prompt - 1),
                blocks_needed(prompt, config.block_size),
                rng.randint(0, 2),
                rid,
            )
        )
    waiting = [
        PlannerSeq(rid, rng.randint(1, scenario.max_prompt_tokens), 0, 0, rng.randint(0, 2), rid)
        for rid in range(scenario.num_running, scenario.num_running + scenario.num_waiting)
    ]
    rng.shuffle(waiting)
    return waiting, running


def _time_calls(scenario: Scenario, num_calls: int) -> tuple[list[float], int, int]:
    """Per-call seconds, chunks and tokens of the last plan."""
    waiting, running = _queues(scenario, random.Random(0))
    free = scenario.config.num_kv_blocks
    timings = []
    plan = plan_step(waiting, running, scenario.config, free)
    for _ in range(num_calls):
        start = time.perf_counter()
        plan = plan_step(waiting, running, scenario.config, free)
        timings.append(time.perf_counter() - start)
    return timings, len(plan.chunks), plan.num_tokens


def _calibration_ms() -> float:
    """Milliseconds for an empty million-iteration loop, to compare machines (best of 5)."""
    best = float("inf")
    for _ in range(5):
        start = time.perf_counter()
        for _ in range(1_000_000):
            pass
        best = min(best, time.perf_counter() - start)
    return best * 1e3


def main() -> None:
    """Print min, median and p99 microseconds per call for a few queue shapes."""
    default = SchedulerConfig()
    small_prompts = SchedulerConfig(max_num_batched_tokens=8192)
    threshold = SchedulerConfig(long_prefill_token_threshold=256)
    encoder = SchedulerConfig(enable_chunked_prefill=False, max_num_batched_tokens=16384)
    scenarios = [
        Scenario("256 waiting, long prompts", default, 256, 0, 4096),
        Scenario("256 waiting, 32-token prompts", small_prompts, 256, 0, 32),
        Scenario("224 waiting + 32 running", threshold, 224, 32, 512),
        Scenario("256 waiting, encoder", encoder, 256, 0, 64),
        Scenario("1024 waiting, 8-token prompts", small_prompts, 1024, 0, 8),
    ]
    print(f"calibration: empty 1e6-iteration loop takes {_calibration_ms():.1f} ms")
    print(
        f"{'scenario':34} {'chunks':>6} {'tokens':>6} {'min_us':>8} {'median_us':>10} {'p99_us':>8}"
    )
    for scenario in scenarios:
        timings, num_chunks, num_tokens = _time_calls(scenario, 2000)
        timings.sort()
        median_us = statistics.median(timings) * 1e6
        p99_us = timings[int(0.99 * len(timings))] * 1e6
        print(
            f"{scenario.name:34} {num_chunks:6d} {num_tokens:6d} {timings[0] * 1e6:8.1f} "
            f"{median_us:10.1f} {p99_us:8.1f}"
        )


if __name__ == "__main__":
    main()
