"""Property: prompts sharing prefixes under cancels, failed steps, pooling errors and evictions end
correctly, and at idle the pool is back to its resting state.

The resting state: every block's refcount is zero, so `num_used == 0` and `num_free == num_total`;
a cached block is free but reusable, so every cached block is a free one (`num_cached ==
num_cached_free`); and the engine's idle gauges (queues, admission, open poolers) are zero. The
hit, miss and eviction counters only grow: hits and misses never exceed the sharing prompts' tokens.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from poolserve.engine.loop import Engine
from poolserve.engine.sched.planner import blocks_needed
from poolserve.models.loader import load_model
from poolserve.models.spec import LoadedModel
from poolserve.pooling.methods import AllPool
from poolserve.types.errors import StepFailedError
from poolserve.types.outputs import PoolingOutput
from poolserve.types.params import PoolingParams
from poolserve.types.tasks import PoolingTask
from tests.engine.test_engine import CPU, _close, _config, _run_all
from tests.engine.test_engine_properties import _poisoned_add_chunk
from tests.engine.test_faults import POISON, StepFaults, wait_idle
from tests.engine.test_prefix_caching import assert_cache_idle

MAX_PROMPT = 64
TASKS = (PoolingTask.EMBED, PoolingTask.EMBED, PoolingTask.TOKEN_EMBED)  # mostly sharing
References = dict[tuple[tuple[int, ...], PoolingTask], np.ndarray]


@pytest.fixture(scope="module")
def llama(tiny_model_dir: Callable[[str], Path]) -> LoadedModel:
    return load_model(str(tiny_model_dir("llama")), device=CPU)


@pytest.fixture(scope="module")
def references() -> References:
    """Single-request outputs without prefix caching, kept across examples."""
    return {}


@dataclass(frozen=True)
class Case:
    """One random scenario: the first prompt runs alone, then the rest together."""

    prompts: tuple[tuple[int, ...], ...]
    tasks: tuple[PoolingTask, ...]
    poisoned: frozenset[int]
    max_num_batched_tokens: int
    long_prefill_token_threshold: int | None
    block_size: int
    num_kv_blocks: int
    async_scheduling: bool
    failed_steps: frozenset[int]
    fail_where: str
    cancels: tuple[tuple[int, float], ...]  # (index among the later prompts, seconds after)


@st.composite
def cases(draw: st.DrawFn) -> Case:
    """Up to 6 prompts cut from two shared prefixes, with their own tails; small KV pools."""
    ids = st.integers(1, 30000).filter(lambda token: token != POISON)
    bases = [draw(st.lists(ids, min_size=40, max_size=40)) for _ in range(2)]
    prompts = []
    for _ in range(draw(st.integers(2, 6))):
        if draw(st.booleans()):  # short: one chunk even beside a long prompt
            cut, max_tail = draw(st.integers(0, 8)), 4
        else:
            cut, max_tail = draw(st.sampled_from((8, 16, 17, 32, 40)) | st.integers(0, 40)), 64
        max_tail = min(max_tail, MAX_PROMPT - cut)
        tail = draw(st.lists(ids, min_size=0 if cut else 1, max_size=max_tail))
        prompts.append(draw(st.sampled_from(bases))[:cut] + tail)
    n = len(prompts)
    tasks = [draw(st.sampled_from(TASKS)) for _ in range(n)]
    poisoned = {draw(st.integers(0, n - 1))} if draw(st.booleans()) else set()
    for i in poisoned:
        prompts[i] = [*prompts[i], POISON]
        tasks[i] = PoolingTask.TOKEN_EMBED  # the poison raises in ALL pooling
    block_size = draw(st.sampled_from((4, 8)))
    # The longest reservation just fits: one-chunk sharing prompts beside a chunked one run short
    # of blocks (and skip storing theirs), and allocations evict.
    min_blocks = max(blocks_needed(len(p), block_size) for p in prompts)
    return Case(
        prompts=tuple(tuple(p) for p in prompts),
        tasks=tuple(tasks),
        poisoned=frozenset(poisoned),
        max_num_batched_tokens=draw(st.integers(16, 40)),
        long_prefill_token_threshold=draw(st.sampled_from((None, 8, 12))),
        block_size=block_size,
        num_kv_blocks=draw(st.integers(max(min_blocks, 1), min_blocks + 4)),
        async_scheduling=draw(st.booleans()),
        failed_steps=frozenset(draw(st.sets(st.integers(0, 12), max_size=3))),
        fail_where=draw(st.sampled_from(("execute", "forward"))),
        cancels=tuple(
            draw(
                st.lists(
                    st.tuples(st.integers(1, n - 1), st.floats(0, 0.03)), max_size=min(n - 1, 2)
                )
            )
        ),
    )


@dataclass(frozen=True)
class Run:
    """What one scenario produced."""

    outcomes: list[BaseException | PoolingOutput]
    cancelled_pending: set[int]
    failed: set[int]  # indices of prompts in a failed step


async def _scenario(llama: LoadedModel, case: Case) -> tuple[Run, Engine]:
    config = _config(
        max_num_batched_tokens=case.max_num_batched_tokens,
        long_prefill_token_threshold=case.long_prefill_token_threshold,
        block_size=case.block_size,
        num_kv_blocks=case.num_kv_blocks,
        async_scheduling=case.async_scheduling,
    )
    engine = Engine(llama, config, CPU)
    faults = StepFaults(engine, lambda step: step.step_index in case.failed_steps, case.fail_where)
    params = [PoolingParams(task=t) for t in case.tasks]
    engine.start()
    try:
        (first,) = engine.submit_many([list(case.prompts[0])], params[0])
        outcomes = list(await asyncio.gather(first, return_exceptions=True))
        futures = [
            engine.submit_many([list(p)], q)[0]
            for p, q in zip(case.prompts[1:], params[1:], strict=True)
        ]
        cancelled_pending, elapsed = set(), 0.0
        for index, at in sorted(case.cancels, key=lambda c: c[1]):
            await asyncio.sleep(at - elapsed)
            elapsed = at
            if not futures[index - 1].done():
                cancelled_pending.add(index)
            engine.cancel_future(futures[index - 1])
        async with asyncio.timeout(10):
            outcomes += await asyncio.gather(*futures, return_exceptions=True)
        await wait_idle(engine)
        assert_cache_idle(engine)
    finally:
        await engine.stop()
    # request ids count from 0 in submission order
    return Run(outcomes, cancelled_pending, faults.failed), engine


def _fill_references(llama: LoadedModel, case: Case, references: References) -> None:
    keys = list(zip(case.prompts, case.tasks, strict=True))
    missing = list(dict.fromkeys(k for k in keys if k not in references and POISON not in k[0]))
    if missing:
        outputs = asyncio.run(
            _run_all(
                llama,
                _config(max_num_batched_tokens=256, enable_prefix_caching=False),
                [list(p) for p, _ in missing],
                [PoolingParams(task=t) for _, t in missing],
            )
        )
        references.update({k: out.data for k, out in zip(missing, outputs, strict=True)})


def _check(index: int, case: Case, run: Run, references: References) -> None:
    outcome = run.outcomes[index]
    if isinstance(outcome, asyncio.CancelledError):
        assert index in run.cancelled_pending
        return
    assert index not in run.cancelled_pending
    may_fail = index in run.failed or index in case.poisoned
    if isinstance(outcome, StepFailedError):
        assert may_fail, outcome
        return
    assert isinstance(outcome, PoolingOutput) and not may_fail, outcome
    assert _close(outcome.data, references[(case.prompts[index], case.tasks[index])]), index


@settings(max_examples=25, deadline=None, database=None)
@given(case=cases())
def test_shared_prefixes_end_correctly_and_the_pool_rests_at_idle(
    llama: LoadedModel, references: References, case: Case
) -> None:
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(AllPool, "add_chunk", _poisoned_add_chunk(AllPool.add_chunk))
        run, engine = asyncio.run(_scenario(llama, case))
    _fill_references(llama, case, references)
    for index in range(len(case.prompts)):
        _check(index, case, run, references)
    sharing = sum(
        len(p) for p, t in zip(case.prompts, case.tasks, strict=True) if t is PoolingTask.EMBED
    )
    blocks = engine.blocks
    assert blocks.num_hit_tokens + blocks.num_miss_tokens <= sharing
