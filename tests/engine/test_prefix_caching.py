"""Prefix caching in the engine: equal outputs on and off, exact counters, eligibility, faults."""

from __future__ import annotations

import asyncio
import random
from collections.abc import Callable, Sequence
from pathlib import Path

import numpy as np
import pytest

from poolserve.engine.loop import Engine
from poolserve.engine.sched.prefix_cache import CacheUse
from poolserve.models.loader import load_model
from poolserve.models.spec import LoadedModel
from poolserve.observability.metrics import ServiceMetrics
from poolserve.types.errors import StepFailedError
from poolserve.types.outputs import PoolingOutput
from poolserve.types.params import PoolingParams
from poolserve.types.tasks import PoolingTask, PoolingType
from tests.engine.test_engine import CPU, _close, _config
from tests.engine.test_faults import StepFaults, assert_idle, nth_step_holding, wait_idle

EMBED = PoolingParams(task=PoolingTask.EMBED)  # LAST pooling on a decoder: shares the cache
TOKEN_EMBED = PoolingParams(task=PoolingTask.TOKEN_EMBED)  # ALL pooling: never looks up
BLOCK = 8
RNG = random.Random(5)


def _tokens(n: int) -> list[int]:
    return [RNG.randrange(1, 30000) for _ in range(n)]


PREFIX = _tokens(40)
FIRST = PREFIX + _tokens(9)
# Shared prefixes of many lengths: block-aligned, one token past, inside one block, the whole
# of another prompt, and a prompt equal to another.
FOLLOWERS = [
    PREFIX + _tokens(5),
    PREFIX[:16],
    PREFIX[:17],
    PREFIX[:16] + _tokens(30),
    PREFIX[:5] + _tokens(3),
    PREFIX,
    [*PREFIX, 7],
    list(FIRST),
    list(FIRST),
    PREFIX[:33] + _tokens(40),
    _tokens(12),
]


@pytest.fixture(scope="module")
def llama(tiny_model_dir: Callable[[str], Path]) -> LoadedModel:
    return load_model(str(tiny_model_dir("llama")), device=CPU)


@pytest.fixture(scope="module")
def mistral(tiny_model_dir: Callable[[str], Path]) -> LoadedModel:
    """Sliding window 24: cached keys beyond the window must stay masked."""
    return load_model(str(tiny_model_dir("mistral")), device=CPU)


def assert_cache_idle(engine: Engine) -> None:
    """Idle: no request holds a block; cached blocks are exactly the free blocks keeping a hash."""
    assert_idle(engine)
    blocks = engine.blocks
    assert all(blocks.refcount(block) == 0 for block in range(blocks.num_total))
    assert blocks.num_free == blocks.num_total and blocks.num_used == 0
    assert blocks.num_cached_free == blocks.num_cached == engine.snapshot().num_kv_blocks_cached


async def _waves(
    engine: Engine, waves: Sequence[Sequence[list[int]]], params: PoolingParams
) -> list[PoolingOutput]:
    """Each wave submitted together once the one before has finished."""
    engine.start()
    try:
        outputs: list[PoolingOutput] = []
        for wave in waves:
            outputs += await asyncio.gather(*engine.submit_many(list(wave), params))
        await wait_idle(engine)
        assert_cache_idle(engine)
    finally:
        await engine.stop()
    return outputs


def _run(
    loaded: LoadedModel,
    waves: Sequence[Sequence[list[int]]],
    config: dict[str, object],
    params: PoolingParams = EMBED,
    embed_pooling: PoolingType | None = None,
) -> tuple[list[np.ndarray], Engine]:
    engine = Engine(loaded, _config(block_size=BLOCK, **config), CPU, embed_pooling=embed_pooling)
    outputs = asyncio.run(_waves(engine, waves, params))
    return [o.data for o in outputs], engine


CHUNKINGS: dict[str, dict[str, object]] = {
    "whole": {"max_num_batched_tokens": 128},
    "chunked": {"max_num_batched_tokens": 24, "long_prefill_token_threshold": 10},
}


@pytest.mark.parametrize("async_scheduling", [True, False])
@pytest.mark.parametrize("chunking", sorted(CHUNKINGS))
@pytest.mark.parametrize("model", ["llama", "mistral"])
def test_outputs_equal_with_caching_on_and_off(
    request: pytest.FixtureRequest, model: str, chunking: str, async_scheduling: bool
) -> None:
    loaded = request.getfixturevalue(model)
    waves = [[FIRST], FOLLOWERS]
    config = {**CHUNKINGS[chunking], "async_scheduling": async_scheduling}
    off, _ = _run(loaded, waves, {**config, "enable_prefix_caching": False})
    on, engine = _run(loaded, waves, config)
    assert all(_close(a, b) for a, b in zip(on, off, strict=True))
    assert engine.blocks.num_hit_tokens >= 8 * 16  # most followers start after cached blocks


def test_hits_misses_and_evictions_are_counted_exactly(llama: LoadedModel) -> None:
    """One prompt at a time on a 4-block pool, so each hit, miss and eviction is known."""
    a = _tokens(24)
    other = _tokens(17)
    waves = [
        [a],  # miss 24; stores 3 full blocks (its reservation: ceil(23 / 8) = 3)
        [a[:8] + _tokens(4)],  # hit 8 (1 block, the cap for 12 tokens), miss 4; stores nothing
        # hit 16 (at most (24 - 1) // 8 = 2 blocks: the last token is computed), miss 8; its
        # block 2 is a twin of the cached one and frees uncached
        [list(a)],
        [other],  # miss 17; needs 2 blocks, 1 uncached free: evicts a's block 2
        [list(a)],  # hit 16 (blocks 0 and 1 survived), miss 8; evicts one of other's blocks
    ]
    _, engine = _run(llama, waves, {"num_kv_blocks": 4})
    snapshot = engine.snapshot()
    assert snapshot.prefix_cache_hit_tokens == 8 + 16 + 16
    assert snapshot.prefix_cache_miss_tokens == 24 + 4 + 8 + 17 + 8
    assert snapshot.prefix_cache_evictions == 2


@pytest.mark.parametrize(("num_kv_blocks", "num_hit_tokens"), [(7, 0), (16, 8)])
def test_prompts_short_of_blocks_run_without_storing(
    llama: LoadedModel, num_kv_blocks: int, num_hit_tokens: int
) -> None:
    """A chunked prompt holds all 7 blocks: the one-chunk ones beside it cannot store theirs."""
    long, short, other = _tokens(56), _tokens(8), _tokens(8)
    config: dict[str, object] = {
        "num_kv_blocks": num_kv_blocks,
        "max_num_batched_tokens": 40,
        "long_prefill_token_threshold": 8,
    }

    async def scenario(**overrides: object) -> tuple[list[np.ndarray], Engine]:
        engine = Engine(llama, _config(block_size=BLOCK, **{**config, **overrides}), CPU)
        engine.start()
        try:
            futures = [
                *engine.submit_many([long], TOKEN_EMBED),
                *engine.submit_many([short, other], EMBED),
            ]
            outputs = list(await asyncio.gather(*futures))
            outputs.append(await engine.submit([*short, 5], EMBED))
            await wait_idle(engine)
            assert_cache_idle(engine)
        finally:
            await engine.stop()
        return [o.data for o in outputs], engine

    on, engine = asyncio.run(scenario())
    off, _ = asyncio.run(scenario(enable_prefix_caching=False))
    assert all(_close(a, b) for a, b in zip(on, off, strict=True))
    assert engine.blocks.num_hit_tokens == num_hit_tokens


@pytest.mark.parametrize(
    ("params", "embed_pooling"),
    [(TOKEN_EMBED, None), (EMBED, PoolingType.MEAN), (EMBED, PoolingType.CLS)],
)
def test_methods_that_read_the_prefix_never_hit(
    llama: LoadedModel, params: PoolingParams, embed_pooling: PoolingType | None
) -> None:
    waves = [[FIRST], [list(FIRST), [*PREFIX, 3]]]
    config: dict[str, object] = {"max_num_batched_tokens": 16}  # chunked: earlier chunks store KV
    on, engine = _run(llama, waves, config, params, embed_pooling)
    off, _ = _run(llama, waves, {**config, "enable_prefix_caching": False}, params, embed_pooling)
    assert all(_close(a, b) for a, b in zip(on, off, strict=True))
    snapshot = engine.snapshot()
    assert (snapshot.prefix_cache_hit_tokens, snapshot.prefix_cache_miss_tokens) == (0, 0)
    assert engine.blocks.num_cached > 0  # they still offered the blocks their chunks wrote


def test_a_chunked_reader_donates_what_it_wrote_and_a_single_chunk_one_writes_nothing(
    llama: LoadedModel,
) -> None:
    async def scenario(budget: int) -> Engine:
        engine = Engine(llama, _config(block_size=BLOCK, max_num_batched_tokens=budget), CPU)
        engine.start()
        try:
            await engine.submit(FIRST, TOKEN_EMBED)  # ALL pooling: donates, never reads
            await engine.submit([*PREFIX, 9], EMBED)
            await wait_idle(engine)
        finally:
            await engine.stop()
        return engine

    chunked = asyncio.run(scenario(budget=16))
    assert chunked.blocks.num_hit_tokens == 40  # FIRST's chunks wrote 0..47: PREFIX's 5 blocks
    single = asyncio.run(scenario(budget=128))
    assert single.blocks.num_hit_tokens == 0


def test_encoders_never_cache(tiny_model_dir: Callable[[str], Path]) -> None:
    bert = load_model(str(tiny_model_dir("bert")), device=CPU)
    engine = Engine(bert, _config(max_num_batched_tokens=128), CPU)
    assert not engine.prefix_caching
    asyncio.run(_waves(engine, [[FIRST[:30]], [FIRST[:30]]], EMBED))
    assert engine.blocks.num_cached == 0 and engine.blocks.num_hit_tokens == 0


def test_eligibility_by_pooling(llama: LoadedModel) -> None:
    engine = Engine(llama, _config(), CPU)
    uses = [engine._cache_use(t, None) for t in (PoolingType.LAST, PoolingType.MEAN)]
    assert uses == [CacheUse.SHARE, CacheUse.DONATE]
    assert engine._cache_use(PoolingType.LAST, np.zeros(3, dtype=np.int64)) is CacheUse.NONE
    off = Engine(llama, _config(enable_prefix_caching=False), CPU)
    assert off._cache_use(PoolingType.LAST, None) is CacheUse.NONE


def test_only_requests_the_next_step_could_admit_look_up(llama: LoadedModel) -> None:
    async def scenario() -> list[tuple[int, int]]:
        engine = Engine(llama, _config(block_size=BLOCK, max_num_seqs=2), CPU)
        engine.start()
        await engine.submit(FIRST, EMBED)
        await engine.stop()  # the queues stay: plan by hand from here
        engine.submit_many([[*PREFIX, i] for i in range(3)], EMBED)
        waiting, _ = engine.queues.planner_inputs()
        requests = engine.queues.waiting.values()
        assert [len(r.block_hashes) for r in requests] == [5, 5, 0]  # the third hashed nothing
        return [(v.num_computed_tokens, v.num_blocks_held) for v in waiting]

    assert asyncio.run(scenario()) == [(40, 5), (40, 5), (0, 0)]


@pytest.mark.parametrize("async_scheduling", [True, False])
def test_blocks_written_by_a_step_in_flight_are_not_hits(
    llama: LoadedModel, async_scheduling: bool
) -> None:
    """FIRST fills step 0; under async scheduling step 1 is planned before step 0 is delivered."""
    follower = [*PREFIX, 11]
    config: dict[str, object] = {
        "max_num_batched_tokens": len(FIRST),
        "async_scheduling": async_scheduling,
    }
    on, engine = _run(llama, [[FIRST, follower]], config)
    off, _ = _run(llama, [[FIRST, follower]], {**config, "enable_prefix_caching": False})
    assert all(_close(a, b) for a, b in zip(on, off, strict=True))
    assert engine.blocks.num_hit_tokens == (0 if async_scheduling else 40)


@pytest.mark.parametrize("where", ["execute", "forward"])
@pytest.mark.parametrize("async_scheduling", [True, False])
def test_a_failed_step_caches_nothing_it_wrote(
    llama: LoadedModel, async_scheduling: bool, where: str
) -> None:
    """FIRST runs in 16-token chunks and its second step fails: only its first chunk is cached."""

    async def scenario() -> tuple[BaseException | PoolingOutput, PoolingOutput, Engine]:
        config = _config(
            block_size=BLOCK, max_num_batched_tokens=16, async_scheduling=async_scheduling
        )
        engine = Engine(llama, config, CPU)
        StepFaults(engine, nth_step_holding(0, 1), where)
        engine.start()
        try:
            (failed,) = await asyncio.gather(
                *engine.submit_many([FIRST], EMBED), return_exceptions=True
            )
            await wait_idle(engine)
            assert engine.blocks.num_cached == 2  # blocks 0 and 1, from the delivered step
            later = await engine.submit([*PREFIX, 11], EMBED)
            await wait_idle(engine)
            assert_cache_idle(engine)
        finally:
            await engine.stop()
        return failed, later, engine

    failed, later, engine = asyncio.run(scenario())
    assert isinstance(failed, StepFailedError)
    assert engine.blocks.num_hit_tokens == 16
    (reference,), _ = _run(llama, [[[*PREFIX, 11]]], {"enable_prefix_caching": False})
    assert _close(later.data, reference)


def test_prefix_cache_counters_are_exported(llama: LoadedModel) -> None:
    _, engine = _run(llama, [[FIRST], [[*PREFIX, 4]]], {})
    metrics = ServiceMetrics()
    metrics.bind_engines({"llama": engine.snapshot}, lambda: True)
    text = metrics.render().decode()
    hit = engine.blocks.num_hit_tokens
    model = '{model_name="llama"}'
    assert f"poolserve_prefix_cache_hit_tokens_total{model} {float(hit)}" in text and hit == 40
    assert f"poolserve_prefix_cache_miss_tokens_total{model} 50.0" in text
    assert f"poolserve_prefix_cache_evictions_total{model} 0.0" in text
    assert f"poolserve_kv_blocks_cached{model} {float(engine.blocks.num_cached)}" in text
