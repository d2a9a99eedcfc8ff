"""The engine core behind its transport: front ends see the engine they would see in-process.

An engine core runs in a thread (the single-process mode) and two `EngineClient`s connect to it
as two front ends would: outputs equal the engine's own, admission counts both front ends,
cancellation frees the core's work, refusals arrive as the engine's own error classes, and a
core that goes silent fails what waits for it.
"""

from __future__ import annotations

import asyncio
import pickle
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from poolserve.config.core import CoreConfig
from poolserve.engine.card import card_of
from poolserve.engine.host import CoreThread, build_engine
from poolserve.engine.sched.request import RequestStatus
from poolserve.frontend.client import EngineClient
from poolserve.types import protocol
from poolserve.types.card import ModelCard
from poolserve.types.errors import (
    DrainingError,
    EngineDeadError,
    InvalidPoolingParamsError,
    InvalidTokenIdError,
    OverloadedError,
    OverloadReason,
    PromptTooLongError,
    StepFailedError,
    UnsupportedTaskError,
)
from poolserve.types.model_info import HEAD_FIELDS
from poolserve.types.params import PoolingParams
from poolserve.types.tasks import HeadKind, PoolingTask
from poolserve.types.validation import validate_params
from tests.engine.waiting import until

EMBED = PoolingParams(task=PoolingTask.EMBED)
PROMPTS = [[5, 6, 7, 8], [9, 10, 11], [12, 13, 14, 15, 16, 17, 18], [19]]


def _config(model: Path, **overrides: object) -> CoreConfig:
    base: dict[str, object] = {
        "model": str(model),
        "max_num_batched_tokens": 64,
        "block_size": 8,
        "max_num_queued_requests": 4,
    }
    return CoreConfig.of(**{**base, **overrides})


@pytest.fixture
def core(tiny_model_dir: Callable[[str], Path]) -> Iterator[CoreThread]:
    thread = CoreThread([_config(tiny_model_dir("llama"))])
    thread.start()
    try:
        yield thread
    finally:
        thread.stop()


def _client(core: CoreThread, timeout_s: float = 10.0) -> EngineClient:
    return EngineClient(core.paths[0], timeout_s=timeout_s)


class _Held:
    """Keeps the core's model thread busy, so everything submitted stays queued."""

    def __init__(self, core: CoreThread) -> None:
        self.release = threading.Event()
        core.engine._worker.submit(self.release.wait)

    def __enter__(self) -> _Held:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release.set()


def _until(condition: Callable[[], bool], timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "condition never held"
        time.sleep(0.01)


def test_outputs_equal_the_engine_run_in_process(
    core: CoreThread, tiny_model_dir: Callable[[str], Path]
) -> None:
    async def through_core() -> list[np.ndarray]:
        client = _client(core)
        await client.connect()
        try:
            futures = await client.submit_many(PROMPTS, EMBED)
            return [output.data for output in await asyncio.gather(*futures)]
        finally:
            await client.close()

    async def in_process() -> list[np.ndarray]:
        engine = build_engine(_config(tiny_model_dir("llama")))
        engine.start()
        try:
            futures = engine.submit_many(PROMPTS, EMBED)
            return [output.data for output in await asyncio.gather(*futures)]
        finally:
            await engine.stop()

    got, want = asyncio.run(through_core()), asyncio.run(in_process())
    for g, w in zip(got, want, strict=True):
        np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-6)
        assert g.dtype == w.dtype and g.shape == w.shape


def test_admission_counts_every_front_end(core: CoreThread) -> None:
    async def run() -> None:
        first, second = _client(core), _client(core)
        await first.connect()
        await second.connect()
        try:
            with _Held(core):
                held = await first.submit_many(PROMPTS, EMBED)  # the queue's 4 places
                # the second front end's copy of the counters may not know yet: the core refuses
                # and its error fails the future
                with pytest.raises(OverloadedError) as refused:
                    await asyncio.gather(*await second.submit_many([[5, 6]], EMBED))
                assert refused.value.reason is OverloadReason.QUEUE_FULL
                assert refused.value.retry_after_s >= 1
            await asyncio.gather(*held)
            while second.admission.queued_requests:  # the core tells every front end
                await asyncio.sleep(0.01)
            # room again: the second front end is admitted
            (output,) = await asyncio.gather(*await second.submit_many([[5, 6]], EMBED))
            assert output.num_prompt_tokens == 2
        finally:
            await first.close()
            await second.close()

    asyncio.run(run())


def test_front_end_mirrors_the_core_counters_for_the_early_429(core: CoreThread) -> None:
    async def run() -> None:
        first, second = _client(core), _client(core)
        await first.connect()
        await second.connect()
        try:
            with _Held(core):
                await first.submit_many(PROMPTS, EMBED)
                deadline = time.monotonic() + 5
                while second.admission.queued_requests < len(PROMPTS):  # the next beat
                    assert time.monotonic() < deadline
                    await asyncio.sleep(0.05)
                with pytest.raises(OverloadedError):
                    second.precheck(1)  # before any tokenization, no round trip
        finally:
            await first.close()
            await second.close()

    asyncio.run(run())


def test_cancelling_frees_the_cores_work(core: CoreThread) -> None:
    engine = core.engine

    def statuses() -> list[RequestStatus]:
        return [request.status for request in engine.queues.by_id.values()]

    async def run() -> None:
        client = _client(core)
        await client.connect()
        try:
            with _Held(core):
                futures = await client.submit_many(PROMPTS[:2], EMBED)
                await until(lambda: core.call(lambda: len(engine.queues.by_id)) == 2)
                client.cancel_future(futures[0])
                assert futures[0].cancelled()
                deadline = time.monotonic() + 5
                while RequestStatus.CANCELLED not in core.call(statuses):
                    assert time.monotonic() < deadline, "the core never cancelled the request"
                    await asyncio.sleep(0.01)
            output = await futures[1]
            assert output.num_prompt_tokens == len(PROMPTS[1])
            assert not client.busy
        finally:
            await client.close()
        # freed once the step that held it was delivered: nothing of it is left in the core
        _until(
            lambda: core.call(lambda: (engine.admission.queued_requests, len(statuses()))) == (0, 0)
        )
        assert core.call(lambda: engine.clone_stats.num_open_poolers) == 0

    asyncio.run(run())


def test_a_caller_that_leaves_before_admission_frees_the_cores_work(core: CoreThread) -> None:
    engine = core.engine
    admitted: list[int] = []
    submit_many = engine.submit_many

    def counting_submit_many(prompts: Any, *args: Any, **kwargs: Any) -> Any:
        futures = submit_many(prompts, *args, **kwargs)
        admitted.append(len(futures))
        return futures

    async def run() -> None:
        client = _client(core)
        await client.connect()
        try:
            with _Held(core):
                futures = await client.submit_many(PROMPTS[:2], EMBED)
                for future in futures:  # before the core has even read the Submit
                    client.cancel_future(future)
                assert not client.busy
                deadline = time.monotonic() + 5
                while not admitted:  # the core admits the Submit, then reads the Cancel
                    assert time.monotonic() < deadline, "the core never admitted the Submit"
                    await asyncio.sleep(0.01)
                assert admitted == [2]
                deadline = time.monotonic() + 5
                while core.call(lambda: len(core.cores[0].pending)):
                    assert time.monotonic() < deadline, "the core kept work nobody waits for"
                    await asyncio.sleep(0.01)
        finally:
            await client.close()

    core.call(lambda: setattr(engine, "submit_many", counting_submit_many))
    try:
        asyncio.run(run())
    finally:
        core.call(lambda: delattr(engine, "submit_many"))
    _until(lambda: core.call(lambda: engine.admission.queued_requests) == 0)


def test_a_front_ends_own_burst_meets_the_429_before_the_core(core: CoreThread) -> None:
    engine = core.engine

    async def run() -> None:
        client = _client(core)
        await client.connect()
        try:
            with _Held(core):
                held = await client.submit_many(PROMPTS, EMBED)  # the queue's 4 places
                # no message from the core in between: its own reservations refuse the fifth
                with pytest.raises(OverloadedError) as refused:
                    await client.submit_many([[5, 6]], EMBED)
                assert refused.value.reason is OverloadReason.QUEUE_FULL
                assert core.call(lambda: engine.admission.queued_requests) <= len(PROMPTS)
            await asyncio.gather(*held)
        finally:
            await client.close()

    asyncio.run(run())


def test_refusals_are_the_engines_own_errors(core: CoreThread) -> None:
    async def run() -> None:
        client = _client(core)
        await client.connect()
        try:
            with pytest.raises(PromptTooLongError):
                await client.submit_many([[1] * (client.max_model_len + 1)], EMBED)
            with pytest.raises(InvalidTokenIdError):
                await client.submit_many([[client.card.vocab_size]], EMBED)
            with pytest.raises(UnsupportedTaskError):
                client.check_params(PoolingParams(task=PoolingTask.CLASSIFY))
            core.call(lambda: setattr(core.engine, "draining", True))
            with pytest.raises(DrainingError):  # the core refuses; its error fails the future
                await asyncio.gather(*await client.submit_many([[5]], EMBED))
        finally:
            await client.close()

    asyncio.run(run())


def test_a_silent_core_fails_what_waits_and_what_comes(core: CoreThread) -> None:
    async def run() -> None:
        client = _client(core, timeout_s=0.5)
        await client.connect()
        try:
            with _Held(core):
                (future,) = await client.submit_many([[5, 6, 7]], EMBED)
                core._loop.call_soon_threadsafe(time.sleep, 2.0)  # type: ignore[union-attr]
                with pytest.raises(EngineDeadError):
                    await asyncio.wait_for(future, 5)
                assert not client.is_alive and client.dead_reason is not None
                with pytest.raises(EngineDeadError):
                    client.precheck(1)
        finally:
            await client.close()

    asyncio.run(run())


def test_a_closed_core_connection_fails_what_waits(core: CoreThread) -> None:
    async def run() -> None:
        client = _client(core)
        await client.connect()
        try:
            with _Held(core):
                (future,) = await client.submit_many([[5, 6, 7]], EMBED)
                core.call(lambda: [stream.close() for stream in list(core.cores[0].front_ends)])
                with pytest.raises(EngineDeadError, match="connection closed"):
                    await asyncio.wait_for(future, 5)
                with pytest.raises(EngineDeadError):
                    await client.submit_many([[5]], EMBED)
        finally:
            await client.close()

    asyncio.run(run())


def test_a_front_end_that_leaves_frees_its_work(core: CoreThread) -> None:
    engine = core.engine
    front_ends = core.cores[0].front_ends

    async def run() -> None:
        client = _client(core)
        await client.connect()
        with _Held(core):
            futures = await client.submit_many(PROMPTS[:3], EMBED)
            await until(lambda: core.call(lambda: engine.admission.queued_requests) == 3)
            assert client.stream is not None
            client.stream.close()  # as a front-end process that dies
            outcomes = await asyncio.gather(*futures, return_exceptions=True)
            assert all(isinstance(o, EngineDeadError) for o in outcomes)
            deadline = time.monotonic() + 5
            while core.call(lambda: (len(front_ends), len(core.cores[0].pending))) != (0, 0):
                assert time.monotonic() < deadline, "the core kept the front end's work"
                await asyncio.sleep(0.01)
        await client.close()

    asyncio.run(run())
    _until(lambda: core.call(lambda: engine.admission.queued_requests) == 0)
    assert core.call(lambda: engine.clone_stats.num_open_poolers) == 0


def test_card_carries_structure_and_no_weights(core: CoreThread) -> None:
    card = ModelCard.loads(core.call(lambda: card_of(core.engine)).dumps())
    spec = core.engine.loaded.spec
    assert (card.architecture, card.vocab_size, card.labels) == (
        spec.architecture,
        spec.vocab_size,
        spec.labels,
    )
    assert card.dtype == str(spec.dtype).removeprefix("torch.")
    assert card.max_model_len == core.engine.max_model_len
    assert card.supported_tasks == frozenset(core.engine.supported_tasks)
    assert (
        card.tokenizer("a b c")["input_ids"] == core.engine.loaded.tokenizer("a b c")["input_ids"]
    )
    for params in (
        EMBED,
        PoolingParams(task=PoolingTask.EMBED, dimensions=3),
        PoolingParams(task=PoolingTask.CLASSIFY),
        PoolingParams(task=PoolingTask.TOKEN_EMBED, normalize=True),
    ):
        assert _outcome(card.pooling_info, params) == _outcome(core.engine.pooling_info, params)


def test_card_of_a_headed_model_carries_its_head_kind_and_no_module(
    tiny_model_dir: Callable[[str], Path],
) -> None:
    engine = build_engine(_config(tiny_model_dir("llama_cls3")))
    card = ModelCard.loads(card_of(engine).dumps())
    info = card.pooling_info
    assert info.head_kind is engine.pooling_info.head_kind is HeadKind.SEQUENCE_CLASSIFIER
    assert info.supported_tasks == engine.pooling_info.supported_tasks
    assert (info.num_labels, card.labels) == (3, engine.loaded.spec.labels)
    modules = [getattr(info, name) for name in (*HEAD_FIELDS.values(), "embed_projection")]
    assert modules == [None] * len(modules)
    # the engine's own head keeps its weights
    assert engine.pooling_info.seq_classifier is not None


def _outcome(info: object, params: PoolingParams) -> str:
    try:
        validate_params(info, params)  # type: ignore[arg-type]
    except Exception as exc:
        return f"{type(exc).__name__}: {exc}"
    return "ok"


@pytest.mark.parametrize(
    "error",
    [
        OverloadedError(OverloadReason.TOKENS_FULL, 2.5, "100 tokens queued"),
        PromptTooLongError(10, 5, 3),
        EngineDeadError("device error"),
        DrainingError(),
        StepFailedError("boom"),
        InvalidTokenIdError(70000, 32000),
        InvalidPoolingParamsError("dimensions", "must be positive"),
        UnsupportedTaskError("classify", ["embed"]),
    ],
)
def test_errors_cross_as_their_own_class(error: Exception) -> None:
    wire = protocol.decode_to_front_end(
        protocol.encode(protocol.Results([], [(7, protocol.wire_error(error))], [], _load()))
    )
    assert isinstance(wire, protocol.Results)
    ((request_id, failure),) = wire.failures
    assert request_id == 7
    rebuilt = protocol.rebuild_error(failure)
    assert type(rebuilt) is type(error)
    assert str(rebuilt) == str(error)
    assert rebuilt.__dict__ == error.__dict__


def test_foreign_errors_cross_as_failed_steps() -> None:
    rebuilt = protocol.rebuild_error(protocol.wire_error(RuntimeError("out of memory")))
    assert type(rebuilt) is StepFailedError and "out of memory" in str(rebuilt)
    forged = protocol.WireError("builtins", "SystemExit", "x", pickle.dumps({}))
    assert type(protocol.rebuild_error(forged)) is StepFailedError


def test_prompts_cross_as_one_buffer_with_their_type_ids() -> None:
    prompts = [np.array([1, 2, 3]), np.array([4]), np.array([5, 6])]
    types = [np.array([0, 0, 1]), None, np.array([1, 1])]
    lengths, typed, frames = protocol.flat_prompts(prompts, types)
    message = protocol.Submit([1, 2, 3], lengths, EMBED, 0, typed)
    decoded = protocol.decode_to_core(protocol.encode(message))
    assert isinstance(decoded, protocol.Submit) and decoded.params == EMBED
    got, got_types = protocol.split_prompts(decoded, [bytes(f) for f in frames])
    assert [g.tolist() for g in got] == [p.tolist() for p in prompts]
    assert got_types is not None
    assert [None if t is None else t.tolist() for t in got_types] == [[0, 0, 1], None, [1, 1]]


def _load() -> protocol.Load:
    return protocol.Load(0, 0, None, None, False, True)
