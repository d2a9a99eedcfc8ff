"""Engine fault paths: failed steps, one request's pooling error, out-of-range token ids."""

from __future__ import annotations

import asyncio
import dataclasses
import random
from collections.abc import Callable, Sequence
from pathlib import Path

import pytest
import torch

from poolserve.engine.loop import Engine
from poolserve.engine.runner import PreparedStep, StepResult
from poolserve.models.loader import load_model
from poolserve.models.spec import LoadedModel
from poolserve.observability.metrics import ServiceMetrics
from poolserve.pooling.methods import AllPool
from poolserve.types.errors import InvalidTokenIdError, StepFailedError
from poolserve.types.limits import SchedulerConfig
from poolserve.types.outputs import PoolingOutput
from poolserve.types.params import PoolingParams
from poolserve.types.tasks import PoolingTask
from tests.engine.test_engine import CPU, _close, _config, _run_all

EMBED = PoolingParams(task=PoolingTask.EMBED)
TOKEN_EMBED = PoolingParams(task=PoolingTask.TOKEN_EMBED)
CHUNK = 8  # the long prompt's chunk size (long_prefill_token_threshold)
POISON = 4242  # a token id whose chunk makes ALL pooling raise in the pooling-error tests


@pytest.fixture(scope="module")
def llama(tiny_model_dir: Callable[[str], Path]) -> LoadedModel:
    return load_model(str(tiny_model_dir("llama")), device=CPU)


class StepFaults:
    """Test-only wrapper of a runner: raises in the steps `pick` chooses, and records every step.

    `where="execute"` raises before the runner runs (the engine alone must clean up);
    `where="forward"` raises inside the model forward (the runner sees the failure too).
    """

    def __init__(
        self, engine: Engine, pick: Callable[[PreparedStep], bool], where: str = "execute"
    ) -> None:
        self.pick = pick
        self.where = where
        self.steps: list[frozenset[int]] = []  # request ids of every step, in execution order
        self.failed: set[int] = set()  # request ids of the failed steps
        self.num_failed = 0
        self._fail_forward = False
        runner = engine.runner
        self._execute = runner.execute
        self._model = runner.loaded.model
        runner.execute = self.execute  # type: ignore[method-assign]
        runner.loaded = dataclasses.replace(runner.loaded, model=self.forward)  # type: ignore[arg-type]

    def execute(self, step: PreparedStep) -> StepResult:
        ids = frozenset(c.request_id for c in step.chunks)
        self.steps.append(ids)
        fail = self.pick(step)
        if fail:
            self.failed |= ids
            self.num_failed += 1
            if self.where == "execute":
                raise RuntimeError(f"injected failure of step {step.step_index}")
        self._fail_forward = fail
        return self._execute(step)

    def forward(self, *args: object, **kwargs: object) -> torch.Tensor:
        if self._fail_forward:
            raise RuntimeError("injected forward failure")
        return self._model(*args, **kwargs)


def nth_step_holding(request_id: int, n: int) -> Callable[[PreparedStep], bool]:
    """Picks the n-th step that holds a chunk of request_id (n = 0: its first chunk)."""
    seen = 0

    def pick(step: PreparedStep) -> bool:
        nonlocal seen
        if not any(c.request_id == request_id for c in step.chunks):
            return False
        seen += 1
        return seen - 1 == n

    return pick


def assert_idle(engine: Engine) -> None:
    """Every counter that a leak would move is back to zero."""
    snapshot = engine.snapshot()
    assert engine.blocks.num_used == 0 and snapshot.num_kv_blocks_used == 0
    assert not engine.queues.waiting and not engine.queues.running and not engine.queues.by_id
    assert snapshot.num_waiting == 0 and snapshot.num_running == 0
    assert engine.admission.queued_requests == 0 and engine.admission.queued_tokens == 0
    assert engine.clone_stats.num_open_poolers == 0 and snapshot.num_open_poolers == 0


async def wait_idle(engine: Engine, timeout_s: float = 10.0) -> None:
    """Wait until the engine holds no request (steps still in flight hold theirs)."""
    async with asyncio.timeout(timeout_s):
        while engine.queues:
            await asyncio.sleep(0.005)


def _prompt(rng: random.Random, length: int) -> list[int]:
    return [rng.randrange(1, 30000) for _ in range(length)]


def _fault_config(async_scheduling: bool) -> SchedulerConfig:
    # The long prompt runs in 8-token chunks beside short ones; 6 blocks hold it (5) or the
    # second long prompt (4) but not both, so a leak of the first starves the second.
    return _config(
        max_num_batched_tokens=16,
        long_prefill_token_threshold=CHUNK,
        num_kv_blocks=6,
        async_scheduling=async_scheduling,
    )


WORKLOAD_RNG = random.Random(11)
LONG = _prompt(WORKLOAD_RNG, 5 * CHUNK)
SHORTS = [_prompt(WORKLOAD_RNG, WORKLOAD_RNG.randint(1, 6)) for _ in range(8)]
LONG_2 = _prompt(WORKLOAD_RNG, 30)
LATER = _prompt(WORKLOAD_RNG, 20)
WORKLOAD = [LONG, *SHORTS, LONG_2]
WORKLOAD_PARAMS = [EMBED] + [(EMBED, TOKEN_EMBED)[i % 2] for i in range(len(SHORTS))] + [EMBED]


@pytest.fixture(scope="module")
def references(llama: LoadedModel) -> list[PoolingOutput]:
    """Each prompt of the workload (then LATER) from a fresh engine."""
    return asyncio.run(
        _run_all(
            llama,
            _config(max_num_batched_tokens=256, async_scheduling=False),
            [*WORKLOAD, LATER],
            [*WORKLOAD_PARAMS, EMBED],
        )
    )


async def _run_workload(
    engine: Engine, prompts: Sequence[list[int]], params: Sequence[PoolingParams]
) -> list[BaseException | PoolingOutput]:
    futures = [engine.submit_many([p], q)[0] for p, q in zip(prompts, params, strict=True)]
    async with asyncio.timeout(20):
        return list(await asyncio.gather(*futures, return_exceptions=True))


@pytest.mark.parametrize("where", ["execute", "forward"])
@pytest.mark.parametrize("async_scheduling", [True, False])
@pytest.mark.parametrize("chunk_index", range(5))
def test_a_failed_step_releases_every_request_it_touched(
    llama: LoadedModel,
    references: list[PoolingOutput],
    chunk_index: int,
    async_scheduling: bool,
    where: str,
) -> None:
    """Fail the step holding chunk k of a long prompt: only its step fails and nothing leaks."""

    async def scenario() -> tuple[list[BaseException | PoolingOutput], PoolingOutput, StepFaults]:
        engine = Engine(llama, _fault_config(async_scheduling), CPU)
        # request ids count from 0 in submission order: the long prompt is request 0
        faults = StepFaults(engine, nth_step_holding(0, chunk_index), where)
        engine.start()
        try:
            outcomes = await _run_workload(engine, WORKLOAD, WORKLOAD_PARAMS)
            await wait_idle(engine)
            assert_idle(engine)
            later = await engine.submit(LATER, EMBED)
            await wait_idle(engine)
            assert_idle(engine)
        finally:
            await engine.stop()
        return outcomes, later, faults

    outcomes, later, faults = asyncio.run(scenario())
    assert faults.num_failed == 1 and 0 in faults.failed
    for request_id, (outcome, ref) in enumerate(zip(outcomes, references, strict=False)):
        if request_id in faults.failed:
            assert isinstance(outcome, StepFailedError), (request_id, outcome)
        else:
            assert isinstance(outcome, PoolingOutput), (request_id, outcome)
            assert _close(outcome.data, ref.data), request_id
    assert _close(later.data, references[-1].data)


@pytest.mark.parametrize("async_scheduling", [True, False])
@pytest.mark.parametrize("chunk_index", [0, 1, 4])
def test_a_pooling_error_fails_only_its_request(
    llama: LoadedModel,
    references: list[PoolingOutput],
    monkeypatch: pytest.MonkeyPatch,
    chunk_index: int,
    async_scheduling: bool,
) -> None:
    """ALL pooling raises on one chunk of one request: the rest of its step and later steps run."""
    original = AllPool.add_chunk

    def poisoned(
        self: AllPool, hidden: torch.Tensor, token_ids: Sequence[int], is_last: bool
    ) -> torch.Tensor | None:
        if POISON in list(token_ids):
            raise RuntimeError("poisoned chunk")
        return original(self, hidden, token_ids, is_last)

    monkeypatch.setattr(AllPool, "add_chunk", poisoned)
    target = list(LONG)
    target[chunk_index * CHUNK + 3] = POISON
    prompts = [target, *WORKLOAD[1:]]
    params = [TOKEN_EMBED, *WORKLOAD_PARAMS[1:]]

    async def scenario() -> tuple[list[BaseException | PoolingOutput], StepFaults]:
        engine = Engine(llama, _fault_config(async_scheduling), CPU)
        steps = StepFaults(engine, lambda step: False)
        engine.start()
        try:
            outcomes = await _run_workload(engine, prompts, params)
            await wait_idle(engine)
            assert_idle(engine)
        finally:
            await engine.stop()
        return outcomes, steps

    outcomes, steps = asyncio.run(scenario())
    error = outcomes[0]
    assert isinstance(error, StepFailedError) and isinstance(error.__cause__, RuntimeError)
    poisoned_step = [step for step in steps.steps if 0 in step][chunk_index]
    assert len(poisoned_step) > 1  # others shared the step that raised
    for request_id in range(1, len(prompts)):
        outcome = outcomes[request_id]
        assert isinstance(outcome, PoolingOutput), (request_id, outcome)
        assert _close(outcome.data, references[request_id].data), request_id


@pytest.mark.parametrize("bad_id", [2**63, 2**64 + 5, -(2**63) - 1, -1, "vocab_size"])
def test_out_of_range_token_ids_are_refused(llama: LoadedModel, bad_id: int | str) -> None:
    """Ids outside [0, vocab_size) get InvalidTokenIdError at submission and nothing is queued."""
    vocab_size = llama.spec.vocab_size
    token_id = vocab_size if bad_id == "vocab_size" else int(bad_id)

    async def scenario() -> tuple[InvalidTokenIdError, Engine]:
        engine = Engine(llama, _config(), CPU)  # not started: a refusal needs no step
        with pytest.raises(InvalidTokenIdError) as refused:
            engine.submit_many([[1, 2], [3, token_id, 4]], EMBED)
        return refused.value, engine

    error, engine = asyncio.run(scenario())
    assert error.token_id == token_id and error.vocab_size == vocab_size
    assert_idle(engine)


def test_the_open_pooler_gauge_is_exported_and_zero_after_failures(
    llama: LoadedModel,
) -> None:
    """/metrics reads poolserve_open_poolers from the engine; it returns to zero after a failure."""

    async def scenario() -> tuple[bytes, bytes]:
        engine = Engine(llama, _fault_config(async_scheduling=True), CPU)
        metrics = ServiceMetrics()
        metrics.bind_engines({"llama": engine.snapshot}, lambda: True)
        StepFaults(engine, nth_step_holding(0, 1))
        engine.submit_many([LONG, *SHORTS[:2]], EMBED)  # queued, not run yet: poolers are open
        busy = metrics.render()
        engine.start()
        try:
            await wait_idle(engine)
        finally:
            await engine.stop()
        return busy, metrics.render()

    busy, idle = asyncio.run(scenario())
    assert b"# HELP poolserve_open_poolers " in idle
    assert b'poolserve_open_poolers{model_name="llama"} 3.0' in busy
    assert b'poolserve_open_poolers{model_name="llama"} 0.0' in idle
