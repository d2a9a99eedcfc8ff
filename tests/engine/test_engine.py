"""Engine: batch invariance, cancellation, admission, overlap of planning with forwards."""

from __future__ import annotations

import asyncio
import random
import threading
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
import torch

import poolserve.pooling.methods as pooling_methods
from poolserve.engine.loop import Engine
from poolserve.models.loader import load_model
from poolserve.models.spec import LoadedModel
from poolserve.types.errors import (
    DrainingError,
    EngineDeadError,
    OverloadedError,
    StepFailedError,
)
from poolserve.types.limits import SchedulerConfig
from poolserve.types.outputs import PoolingOutput
from poolserve.types.params import PoolingParams
from poolserve.types.tasks import PoolingTask

CPU = torch.device("cpu")
TASKS = (PoolingTask.EMBED, PoolingTask.TOKEN_EMBED)


def _config(**overrides: object) -> SchedulerConfig:
    base: dict[str, object] = {
        "max_num_batched_tokens": 64,
        "max_num_seqs": 16,
        "block_size": 8,
        "num_kv_blocks": 512,
    }
    base.update(overrides)
    return SchedulerConfig(**base)  # type: ignore[arg-type]


def _close(a: np.ndarray, b: np.ndarray) -> bool:
    scale = max(float(np.abs(b).max()), 1e-6)
    return a.shape == b.shape and float(np.abs(a - b).max()) <= 1e-4 * scale


async def _run_all(
    loaded: LoadedModel,
    config: SchedulerConfig,
    prompts: list[list[int]],
    params: list[PoolingParams],
) -> list[PoolingOutput]:
    engine = Engine(loaded, config, CPU)
    engine.start()
    try:
        futures = [engine.submit_many([p], q)[0] for p, q in zip(prompts, params, strict=True)]
        return list(await asyncio.gather(*futures))
    finally:
        await engine.stop()


@pytest.fixture(scope="module")
def llama(tiny_model_dir: Callable[[str], Path]) -> LoadedModel:
    return load_model(str(tiny_model_dir("llama")), device=CPU)


def _workload(seed: int, n: int, max_len: int) -> tuple[list[list[int]], list[PoolingParams]]:
    rng = random.Random(seed)
    prompts = [[rng.randrange(1, 30000) for _ in range(rng.randint(1, max_len))] for _ in range(n)]
    params = [PoolingParams(task=rng.choice(TASKS)) for _ in range(n)]
    return prompts, params


@pytest.mark.parametrize("async_scheduling", [True, False])
def test_batch_invariance(llama: LoadedModel, async_scheduling: bool) -> None:
    """>= 50 concurrent prompts, chunked and interleaved, equal each prompt run alone."""
    prompts, params = _workload(seed=1, n=56, max_len=150)
    mixed = asyncio.run(
        _run_all(llama, _config(async_scheduling=async_scheduling), prompts, params)
    )
    alone_config = _config(max_num_batched_tokens=256, async_scheduling=False)
    for prompt, param, got in zip(prompts, params, mixed, strict=True):
        (alone,) = asyncio.run(_run_all(llama, alone_config, [prompt], [param]))
        assert _close(got.data, alone.data), (len(prompt), param.task)


def test_removing_the_clone_corrupts_async_outputs(
    llama: LoadedModel, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Under async scheduling, token-level outputs viewing the hidden buffer must be cloned."""
    prompts, _ = _workload(seed=2, n=24, max_len=40)
    params = [PoolingParams(task=PoolingTask.TOKEN_EMBED, normalize=False)] * len(prompts)
    config = _config(max_num_batched_tokens=48)
    good = asyncio.run(_run_all(llama, config, prompts, params))
    monkeypatch.setattr(pooling_methods, "_own", lambda tensor, stats: tensor)
    bad = asyncio.run(_run_all(llama, config, prompts, params))
    assert any(not _close(b.data, g.data) for b, g in zip(bad, good, strict=True))


def test_cancellation_frees_blocks_and_pooling_state(llama: LoadedModel) -> None:
    """Cancelling at random points leaves nothing held; the rest stay correct."""
    prompts, params = _workload(seed=3, n=40, max_len=200)

    async def scenario() -> tuple[Engine, list[PoolingOutput | None]]:
        engine = Engine(llama, _config(max_num_batched_tokens=32), CPU)
        engine.start()
        futures = [engine.submit_many([p], q)[0] for p, q in zip(prompts, params, strict=True)]
        rng = random.Random(4)
        doomed = set(rng.sample(range(len(futures)), 15))
        for _ in range(6):
            await asyncio.sleep(0.01)
            for i in sorted(doomed)[:3]:
                engine.cancel_future(futures[i])
                doomed.discard(i)
        for i in doomed:
            engine.cancel_future(futures[i])
        results = await asyncio.gather(*futures, return_exceptions=True)
        while engine.queues:
            await asyncio.sleep(0.01)
        await engine.stop()
        return engine, [r if isinstance(r, PoolingOutput) else None for r in results]

    engine, results = asyncio.run(scenario())
    assert engine.blocks.num_used == 0
    assert engine.clone_stats.num_open_poolers == 0
    assert engine.admission.queued_requests == 0 and engine.admission.queued_tokens == 0
    survivors = [i for i, r in enumerate(results) if r is not None]
    assert len(survivors) >= 25
    alone = asyncio.run(
        _run_all(
            llama,
            _config(max_num_batched_tokens=256),
            [prompts[i] for i in survivors],
            [params[i] for i in survivors],
        )
    )
    for i, ref in zip(survivors, alone, strict=True):
        got = results[i]
        assert got is not None and _close(got.data, ref.data)


def test_admission_burst_refuses_exactly_the_excess(llama: LoadedModel) -> None:
    """With room for 5 queued requests, a burst of 12 gets 7 overload errors and no model time."""

    async def scenario() -> tuple[int, int, int]:
        engine = Engine(llama, _config(max_num_queued_requests=5), CPU)  # not started: nothing runs
        refused = 0
        for _ in range(12):
            try:
                engine.submit_many([[1, 2, 3]], PoolingParams(task=PoolingTask.EMBED))
            except OverloadedError as exc:
                assert exc.retry_after_s >= 1
                refused += 1
        return refused, engine.num_steps, len(engine.queues.waiting)

    refused, steps, waiting = asyncio.run(scenario())
    assert (refused, steps, waiting) == (7, 0, 5)


def test_next_step_is_planned_while_the_current_one_runs(
    llama: LoadedModel, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With a slow model, the plan for step N+1 exists before step N returns."""
    events: list[tuple[str, int, float]] = []
    lock = threading.Lock()

    async def scenario() -> None:
        engine = Engine(llama, _config(max_num_batched_tokens=16), CPU)
        prepare, execute = engine.runner.prepare, engine.runner.execute

        def slow_execute(step):  # type: ignore[no-untyped-def]
            time.sleep(0.05)
            result = execute(step)
            with lock:
                events.append(("executed", step.step_index, time.perf_counter()))
            return result

        def traced_prepare(step_index, chunks):  # type: ignore[no-untyped-def]
            with lock:
                events.append(("prepared", step_index, time.perf_counter()))
            return prepare(step_index, chunks)

        monkeypatch.setattr(engine.runner, "execute", slow_execute)
        monkeypatch.setattr(engine.runner, "prepare", traced_prepare)
        engine.start()
        await engine.submit(list(range(1, 81)), PoolingParams(task=PoolingTask.EMBED))
        await engine.stop()

    asyncio.run(scenario())
    prepared = {i: t for kind, i, t in events if kind == "prepared"}
    executed = {i: t for kind, i, t in events if kind == "executed"}
    assert len(executed) == 5  # 80 tokens under a budget of 16
    for step in range(4):
        assert prepared[step + 1] < executed[step]


def test_a_failing_step_fails_only_its_requests(
    llama: LoadedModel, monkeypatch: pytest.MonkeyPatch
) -> None:
    """One step raises: its requests get StepFailedError, later requests are served correctly."""

    async def scenario() -> tuple[list[BaseException | PoolingOutput], PoolingOutput, Engine]:
        engine = Engine(llama, _config(), CPU)
        execute = engine.runner.execute
        calls = {"n": 0}

        def flaky(step):  # type: ignore[no-untyped-def]
            calls["n"] += 1
            if calls["n"] == 1:
                raise RuntimeError("boom")
            return execute(step)

        monkeypatch.setattr(engine.runner, "execute", flaky)
        engine.start()
        first = engine.submit_many([[1, 2, 3], [4, 5]], PoolingParams(task=PoolingTask.EMBED))
        failed = await asyncio.gather(*first, return_exceptions=True)
        later = await engine.submit([1, 2, 3], PoolingParams(task=PoolingTask.EMBED))
        await engine.stop()
        return failed, later, engine

    failed, later, engine = asyncio.run(scenario())
    assert all(isinstance(f, StepFailedError) for f in failed)
    assert engine.dead_reason is None and not engine.queues
    (alone,) = asyncio.run(
        _run_all(llama, _config(), [[1, 2, 3]], [PoolingParams(task=PoolingTask.EMBED)])
    )
    assert _close(later.data, alone.data)


def test_a_device_error_marks_the_engine_dead(
    llama: LoadedModel, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A CUDA error poisons the context: requests fail and new ones are refused."""

    async def scenario() -> tuple[BaseException | PoolingOutput, Engine]:
        engine = Engine(llama, _config(), CPU)

        def broken(step):  # type: ignore[no-untyped-def]
            raise RuntimeError("CUDA error: an illegal memory access was encountered")

        monkeypatch.setattr(engine.runner, "execute", broken)
        engine.start()
        (future,) = engine.submit_many([[1, 2, 3]], PoolingParams(task=PoolingTask.EMBED))
        (outcome,) = await asyncio.gather(future, return_exceptions=True)
        with pytest.raises(EngineDeadError):
            engine.precheck(1)
        await engine.stop()
        return outcome, engine

    outcome, engine = asyncio.run(scenario())
    assert isinstance(outcome, EngineDeadError)
    assert engine.dead_reason is not None and "illegal memory access" in engine.dead_reason


def test_drain_finishes_inflight_work_and_refuses_new(llama: LoadedModel) -> None:
    """drain(): new submissions get DrainingError, queued ones still complete."""

    async def scenario() -> tuple[list[PoolingOutput], bool]:
        engine = Engine(llama, _config(max_num_batched_tokens=16), CPU)
        engine.start()
        prompts, _ = _workload(seed=5, n=10, max_len=60)
        futures = engine.submit_many(prompts, PoolingParams(task=PoolingTask.EMBED))
        drained = asyncio.ensure_future(engine.drain(timeout_s=60))
        await asyncio.sleep(0)
        with pytest.raises(DrainingError):
            engine.submit_many([[1, 2]], PoolingParams(task=PoolingTask.EMBED))
        outputs = list(await asyncio.gather(*futures))
        return outputs, await drained

    outputs, clean = asyncio.run(scenario())
    assert clean and len(outputs) == 10
