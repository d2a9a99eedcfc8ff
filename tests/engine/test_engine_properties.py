"""Property: under random prompts, budgets, cancels, failed steps and pooling errors, the engine
ends every request exactly once, correctly, and leaks nothing."""

from __future__ import annotations

import asyncio
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from poolserve.engine.loop import Engine
from poolserve.models.loader import load_model
from poolserve.models.spec import LoadedModel
from poolserve.pooling.methods import AllPool
from poolserve.types.errors import StepFailedError
from poolserve.types.outputs import PoolingOutput
from poolserve.types.params import PoolingParams
from poolserve.types.tasks import PoolingTask
from tests.engine.test_engine import CPU, _close, _config, _run_all
from tests.engine.test_faults import POISON, StepFaults, assert_idle, wait_idle

MAX_PROMPT = 80
TASKS = (PoolingTask.EMBED, PoolingTask.TOKEN_EMBED)
References = dict[tuple[tuple[int, ...], PoolingTask], np.ndarray]


@pytest.fixture(scope="module")
def llama(tiny_model_dir: Callable[[str], Path]) -> LoadedModel:
    return load_model(str(tiny_model_dir("llama")), device=CPU)


@pytest.fixture(scope="module")
def references() -> References:
    """Single-request outputs from a fresh engine, kept across examples."""
    return {}


@dataclass(frozen=True)
class Case:
    """One random scenario."""

    prompts: tuple[tuple[int, ...], ...]
    tasks: tuple[PoolingTask, ...]
    poisoned: frozenset[int]  # requests whose ALL pooling raises on the chunk holding POISON
    max_num_batched_tokens: int
    block_size: int
    num_kv_blocks: int
    async_scheduling: bool
    failed_steps: frozenset[int]
    fail_where: str
    cancels: tuple[tuple[int, float], ...]  # (request index, seconds after submission)


@st.composite
def cases(draw: st.DrawFn) -> Case:
    """Small scenarios: up to 5 prompts of 1..80 tokens, budgets small enough to chunk."""
    ids = st.integers(1, 30000).filter(lambda token: token != POISON)
    lengths = draw(st.lists(st.integers(1, MAX_PROMPT), min_size=1, max_size=5))
    prompts = [draw(st.lists(ids, min_size=length, max_size=length)) for length in lengths]
    n = len(prompts)
    tasks = [draw(st.sampled_from(TASKS)) for _ in range(n)]
    poisoned = {draw(st.integers(0, n - 1))} if draw(st.booleans()) else set()
    for i in poisoned:
        prompts[i][draw(st.integers(0, len(prompts[i]) - 1))] = POISON
        tasks[i] = PoolingTask.TOKEN_EMBED  # the poison raises in ALL pooling
    block_size = draw(st.sampled_from((4, 8)))
    min_blocks = math.ceil((MAX_PROMPT - 1) / block_size)  # any prompt fits the KV pool
    return Case(
        prompts=tuple(tuple(p) for p in prompts),
        tasks=tuple(tasks),
        poisoned=frozenset(poisoned),
        max_num_batched_tokens=draw(st.integers(16, 32)),
        block_size=block_size,
        num_kv_blocks=draw(st.integers(min_blocks, 3 * min_blocks)),
        async_scheduling=draw(st.booleans()),
        failed_steps=frozenset(draw(st.sets(st.integers(0, 10), max_size=3))),
        fail_where=draw(st.sampled_from(("execute", "forward"))),
        cancels=tuple(
            draw(st.lists(st.tuples(st.integers(0, n - 1), st.floats(0, 0.03)), max_size=min(n, 3)))
        ),
    )


class CountingObserver:
    """Counts finished requests, so a second outcome for one request cannot hide."""

    def __init__(self) -> None:
        self.num_done = 0

    def on_step(self, num_tokens: int, duration_s: float) -> None:
        """Ignore."""

    def on_request_done(self, queue_time_s: float, inference_time_s: float) -> None:
        self.num_done += 1

    def on_reject(self, reason: str) -> None:
        """Ignore."""


@dataclass(frozen=True)
class Run:
    """What one scenario produced."""

    outcomes: list[BaseException | PoolingOutput]
    request_ids: list[int]
    cancelled_pending: set[int]  # indices cancelled while their future was not done
    failed: set[int]  # request ids of the failed steps
    num_done: int


def _poisoned_add_chunk(original: Callable[..., torch.Tensor | None]) -> Callable[..., object]:
    def add_chunk(
        self: AllPool, hidden: torch.Tensor, token_ids: Sequence[int], is_last: bool
    ) -> torch.Tensor | None:
        if POISON in list(token_ids):
            raise RuntimeError("poisoned chunk")
        return original(self, hidden, token_ids, is_last)

    return add_chunk


def _request_id(engine: Engine, future: asyncio.Future[PoolingOutput]) -> int:
    request = engine.queues.request_of(future)
    assert request is not None
    return request.request_id


async def _scenario(llama: LoadedModel, case: Case) -> Run:
    config = _config(
        max_num_batched_tokens=case.max_num_batched_tokens,
        block_size=case.block_size,
        num_kv_blocks=case.num_kv_blocks,
        async_scheduling=case.async_scheduling,
    )
    observer = CountingObserver()
    engine = Engine(llama, config, CPU, observer=observer)
    faults = StepFaults(engine, lambda step: step.step_index in case.failed_steps, case.fail_where)
    engine.start()
    try:
        futures = [
            engine.submit_many([list(p)], PoolingParams(task=t))[0]
            for p, t in zip(case.prompts, case.tasks, strict=True)
        ]
        request_ids = [_request_id(engine, f) for f in futures]
        cancelled_pending = set()
        elapsed = 0.0
        for index, at in sorted(case.cancels, key=lambda c: c[1]):
            await asyncio.sleep(at - elapsed)
            elapsed = at
            if not futures[index].done():
                cancelled_pending.add(index)
            engine.cancel_future(futures[index])
        async with asyncio.timeout(10):
            outcomes = list(await asyncio.gather(*futures, return_exceptions=True))
        await wait_idle(engine)
        assert_idle(engine)
    finally:
        await engine.stop()
    return Run(outcomes, request_ids, cancelled_pending, faults.failed, observer.num_done)


def _reference_outputs(llama: LoadedModel, case: Case, references: References) -> None:
    """Fill in the single-request outputs of the case's prompts not seen before."""
    keys = [(p, t) for p, t in zip(case.prompts, case.tasks, strict=True)]
    missing = list(dict.fromkeys(k for k in keys if k not in references and POISON not in k[0]))
    if not missing:
        return
    outputs = asyncio.run(
        _run_all(
            llama,
            _config(max_num_batched_tokens=256, async_scheduling=False),
            [list(p) for p, _ in missing],
            [PoolingParams(task=t) for _, t in missing],
        )
    )
    references.update({k: out.data for k, out in zip(missing, outputs, strict=True)})


def _check_outcome(index: int, case: Case, run: Run, references: References) -> None:
    outcome = run.outcomes[index]
    if isinstance(outcome, asyncio.CancelledError):
        assert index in run.cancelled_pending  # only the caller cancels
        return
    assert index not in run.cancelled_pending  # a cancelled request gets no other outcome
    may_fail = run.request_ids[index] in run.failed or index in case.poisoned
    if isinstance(outcome, StepFailedError):
        assert may_fail, outcome
        return
    assert isinstance(outcome, PoolingOutput), outcome
    assert not may_fail  # no result for a request that failed
    reference = references[(case.prompts[index], case.tasks[index])]
    assert _close(outcome.data, reference), index


@settings(max_examples=25, deadline=None, database=None)
@given(case=cases())
def test_every_request_ends_once_correctly_and_nothing_leaks(
    llama: LoadedModel, references: References, case: Case
) -> None:
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(AllPool, "add_chunk", _poisoned_add_chunk(AllPool.add_chunk))
        run = asyncio.run(_scenario(llama, case))
    _reference_outputs(llama, case, references)
    assert all(
        isinstance(o, PoolingOutput | StepFailedError | asyncio.CancelledError)
        for o in run.outcomes
    )
    assert run.num_done == sum(isinstance(o, PoolingOutput) for o in run.outcomes)
    for index in range(len(case.prompts)):
        _check_outcome(index, case, run, references)
