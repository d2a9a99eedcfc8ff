"""Engine benchmark on CPU: offline throughput, idle fraction between steps, planning cost per step.

Run from the repository root: `python -m bench engine [--quick] [--profile]`. Builds a random
decoder shaped like Qwen3-0.6B (hidden 1024, intermediate 3072, 16 heads, 8 KV heads, head_dim
128, vocab 151936) with fewer layers, float32, and also runs the real all-MiniLM-L6-v2. Prints
markdown tables; asserts nothing.
"""

from __future__ import annotations

import argparse
import asyncio
import cProfile
import io
import itertools
import logging
import pstats
import statistics
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path

import torch

from bench.common.corpus import build_workload
from bench.common.models import CPU, EMBED, save_decoder
from poolserve.engine.loop import Engine
from poolserve.engine.runner import PreparedStep, StepResult
from poolserve.models.loader import load_model
from poolserve.models.spec import LoadedModel
from poolserve.types.limits import SchedulerConfig

logger = logging.getLogger(__name__)

DECODER_CONFIG = SchedulerConfig(max_num_batched_tokens=2048, num_kv_blocks=1024)
ENCODER_CONFIG = SchedulerConfig(max_num_batched_tokens=2048, enable_chunked_prefill=False)
NUM_QUEUED = 256


@dataclass(frozen=True)
class Mode:
    """Sizes of one benchmark mode."""

    num_layers: int
    num_prompts: int
    num_minilm_prompts: int
    num_planned_steps: int  # live steps timed with NUM_QUEUED requests queued


MODES = {"quick": Mode(2, 48, 96, 4), "full": Mode(4, 200, 400, 8)}


@dataclass
class Recorder:
    """Start/end perf_counter times of forwards and plan calls (appended from two threads)."""

    forwards: list[tuple[float, float]] = field(default_factory=list)
    plans: list[tuple[float, int, bool]] = field(default_factory=list)  # (seconds, queued, step?)


@dataclass(frozen=True)
class OfflineRow:
    """One offline-throughput row."""

    name: str
    tokens: int
    steps: int
    wall_s: float
    busy_s: float
    median_gap_ms: float

    @property
    def tokens_per_s(self) -> float:
        """Prompt tokens per wall second, first submit to last result."""
        return self.tokens / self.wall_s

    @property
    def idle_fraction(self) -> float:
        """Share of wall time with no forward running."""
        return 1.0 - self.busy_s / self.wall_s


def instrument(engine: Engine, recorder: Recorder) -> None:
    """Wrap the runner's execute and the loop's plan+prepare to record their times."""
    execute = engine.runner.execute
    plan_and_prepare = engine._plan_and_prepare

    def timed_execute(step: PreparedStep) -> StepResult:
        start = time.perf_counter()
        try:
            return execute(step)
        finally:
            recorder.forwards.append((start, time.perf_counter()))

    def timed_plan() -> PreparedStep | None:
        queued = len(engine.queues.waiting) + len(engine.queues.running)
        start = time.perf_counter()
        prepared = plan_and_prepare()
        recorder.plans.append((time.perf_counter() - start, queued, prepared is not None))
        return prepared

    engine.runner.execute = timed_execute  # type: ignore[method-assign]
    engine._plan_and_prepare = timed_plan  # type: ignore[method-assign]


async def offline(
    name: str, loaded: LoadedModel, config: SchedulerConfig, prompts: tuple[tuple[int, ...], ...]
) -> OfflineRow:
    """Submit every prompt at once after a warm-up; time first submit to last result."""
    engine = Engine(loaded, config, CPU)
    recorder = Recorder()
    instrument(engine, recorder)
    engine.start()
    await asyncio.gather(*engine.submit_many([list(p) for p in prompts[:4]], EMBED))
    recorder.forwards.clear()
    steps_before = engine.num_steps
    start = time.perf_counter()
    await asyncio.gather(*engine.submit_many([list(p) for p in prompts], EMBED))
    wall = time.perf_counter() - start
    await engine.stop()
    forwards = sorted(recorder.forwards)
    gaps = [b[0] - a[1] for a, b in itertools.pairwise(forwards)]
    return OfflineRow(
        name,
        sum(len(p) for p in prompts),
        engine.num_steps - steps_before,
        wall,
        sum(end - begin for begin, end in forwards),
        statistics.median(gaps) * 1e3 if gaps else 0.0,
    )


async def live_plan_times(
    loaded: LoadedModel, prompts: tuple[tuple[int, ...], ...], num_steps: int
) -> list[float]:
    """Plan+prepare seconds of the first steps the running loop plans with the queue full."""
    engine = Engine(loaded, DECODER_CONFIG, CPU)
    recorder = Recorder()
    instrument(engine, recorder)
    engine.start()
    engine.submit_many([list(p) for p in prompts], EMBED)
    while engine.num_steps < num_steps:
        await asyncio.sleep(0.05)
    await engine.stop()
    return [s for s, _, is_step in recorder.plans if is_step]


async def isolated_plan_times(
    loaded: LoadedModel, prompts: tuple[tuple[int, ...], ...], profile: cProfile.Profile | None
) -> list[tuple[float, int]]:
    """Plan+prepare seconds with the loop stopped (no forward alongside) until the queue empties."""
    engine = Engine(loaded, DECODER_CONFIG, CPU)
    engine.submit_many([list(p) for p in prompts], EMBED)
    times = []
    while engine.queues.has_work:
        queued = len(engine.queues.waiting) + len(engine.queues.running)
        if profile is not None:
            profile.enable()
        start = time.perf_counter()
        prepared = engine._plan_and_prepare()
        elapsed = time.perf_counter() - start
        if profile is not None:
            profile.disable()
        if prepared is None:
            break
        times.append((elapsed, queued))
    await engine.stop()
    return times


def _ms(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))] * 1e3


def offline_table(rows: list[OfflineRow]) -> str:
    """Markdown table of offline rows."""
    lines = [
        "| workload | tokens | steps | wall s | tokens/s | forward s | idle fraction "
        "| median gap ms |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    lines += [
        f"| {r.name} | {r.tokens} | {r.steps} | {r.wall_s:.2f} | {r.tokens_per_s:.0f} | "
        f"{r.busy_s:.2f} | {r.idle_fraction:.2%} | {r.median_gap_ms:.2f} |"
        for r in rows
    ]
    return "\n".join(lines)


def plan_table(live: list[float], isolated: list[tuple[float, int]]) -> str:
    """Markdown table of plan+prepare times per step."""
    full = [s for s, queued in isolated if queued >= 200]
    rows = [
        ("live loop, first steps (forward running alongside)", live),
        ("loop stopped, steps with >= 200 queued", full),
        ("loop stopped, every step until empty", [s for s, _ in isolated]),
    ]
    lines = [
        "| plan + prepare per step | steps | median ms | p90 ms | max ms |",
        "|---|---:|---:|---:|---:|",
    ]
    lines += [
        f"| {name} | {len(v)} | {_ms(v, 0.5):.3f} | {_ms(v, 0.9):.3f} | {_ms(v, 1.0):.3f} |"
        for name, v in rows
        if v
    ]
    return "\n".join(lines)


def profile_report(profile: cProfile.Profile) -> str:
    """Top functions by own time of the profiled plan+prepare calls."""
    out = io.StringIO()
    pstats.Stats(profile, stream=out).strip_dirs().sort_stats("tottime").print_stats(12)
    return out.getvalue()


async def run(mode: Mode, want_profile: bool, emit: Callable[[str], None]) -> None:
    """Every measurement of one mode, emitting tables as they complete."""
    workload = build_workload(mode.num_prompts, seed=0)
    queued = build_workload(NUM_QUEUED, seed=1)
    minilm_prompts = build_workload(mode.num_minilm_prompts, seed=2, max_tokens=512)
    emit(
        f"decoder workload: {workload.describe()}\n\nqueued workload: {queued.describe()}\n\n"
        f"MiniLM workload: {minilm_prompts.describe()}\n"
    )
    with tempfile.TemporaryDirectory() as tmp:
        decoder = load_model(str(save_decoder(Path(tmp), mode.num_layers)), device=CPU)
    label = f"Qwen3-0.6B shape, {mode.num_layers} layers, fp32"
    rows = [
        await offline(
            f"{label}, async {'on' if on else 'off'}",
            decoder,
            replace(DECODER_CONFIG, async_scheduling=on),
            workload.prompts,
        )
        for on in (True, False)
    ]
    minilm = load_model(None, device=CPU)
    rows += [
        await offline(
            f"all-MiniLM-L6-v2, fp32, async {'on' if on else 'off'}",
            minilm,
            replace(ENCODER_CONFIG, async_scheduling=on),
            minilm_prompts.prompts,
        )
        for on in (True, False)
    ]
    emit(offline_table(rows) + "\n")
    live = await live_plan_times(decoder, queued.prompts, mode.num_planned_steps)
    profile = cProfile.Profile() if want_profile else None
    isolated = await isolated_plan_times(decoder, queued.prompts, profile)
    emit(plan_table(live, isolated) + "\n")
    if profile is not None:
        emit("```\n" + profile_report(profile) + "```\n")


def main() -> None:
    """Parse flags and run."""
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--quick", action="store_true", help="smaller workloads (about 2 minutes)")
    parser.add_argument("--profile", action="store_true", help="cProfile the plan+prepare calls")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    mode = MODES["quick" if args.quick else "full"]
    logger.info("mode %s, torch threads %d", mode, torch.get_num_threads())
    asyncio.run(run(mode, args.profile, print))


if __name__ == "__main__":
    main()
