"""Planner tables written by hand from the rules, and a seeded simulation with a real allocator."""

from __future__ import annotations

import random

import pytest

from poolserve.engine.sched.planner import (
    BatchPlan,
    ImageRun,
    PlannerSeq,
    ScheduledChunk,
    blocks_needed,
    max_prompt_tokens,
    plan_step,
)
from poolserve.types.errors import PromptTooLongError
from poolserve.types.limits import BACKGROUND_PRIORITY, BACKGROUND_SHARE, SchedulerConfig
from tests.engine.sched.planner_harness import Arrival, Harness, run_steps

C = ScheduledChunk  # expected chunks read as C(request_id, start, num_tokens, is_last, new_blocks)


def _cfg(**kwargs: object) -> SchedulerConfig:
    return SchedulerConfig(**{"block_size": 16, "num_kv_blocks": 64, **kwargs})  # type: ignore[arg-type]


MULTI_STEP_CASES = {
    "95_tokens_budget_10": (
        _cfg(max_num_batched_tokens=10),
        [Arrival(0, 95)],
        [
            [C(0, 0, 10, False, 6)],
            [C(0, 10, 10, False, 0)],
            [C(0, 20, 10, False, 0)],
            [C(0, 30, 10, False, 0)],
            [C(0, 40, 10, False, 0)],
            [C(0, 50, 10, False, 0)],
            [C(0, 60, 10, False, 0)],
            [C(0, 70, 10, False, 0)],
            [C(0, 80, 10, False, 0)],
            [C(0, 90, 5, True, 0)],
        ],
    ),
    "threshold_lets_short_prompts_run_beside_a_long_one": (
        _cfg(max_num_batched_tokens=10, long_prefill_token_threshold=4),
        [Arrival(0, 20), Arrival(1, 3), Arrival(2, 2)],
        [
            [C(0, 0, 4, False, 2), C(1, 0, 3, True, 0), C(2, 0, 2, True, 0)],
            [C(0, 4, 4, False, 0)],
            [C(0, 8, 4, False, 0)],
            [C(0, 12, 4, False, 0)],
            [C(0, 16, 4, True, 0)],
        ],
    ),
    "no_threshold_short_prompts_wait_for_the_long_one": (
        _cfg(max_num_batched_tokens=10),
        [Arrival(0, 20), Arrival(1, 3), Arrival(2, 2)],
        [
            [C(0, 0, 10, False, 2)],
            [C(0, 10, 10, True, 0)],
            [C(1, 0, 3, True, 0), C(2, 0, 2, True, 0)],
        ],
    ),
    "partial_prefill_continues_before_a_higher_priority_arrival": (
        _cfg(max_num_batched_tokens=8),
        [Arrival(0, 20), Arrival(1, 6, priority=-1, at_step=1)],
        [
            [C(0, 0, 8, False, 2)],
            [C(0, 8, 8, False, 0)],
            [C(0, 16, 4, True, 0), C(1, 0, 4, False, 1)],
            [C(1, 4, 2, True, 0)],
        ],
    ),
    "encoder_prompts_run_whole_in_arrival_order": (
        _cfg(max_num_batched_tokens=10, enable_chunked_prefill=False),
        [Arrival(0, 4), Arrival(1, 8), Arrival(2, 3), Arrival(3, 2)],
        [[C(0, 0, 4, True, 0)], [C(1, 0, 8, True, 0)], [C(2, 0, 3, True, 0), C(3, 0, 2, True, 0)]],
    ),
    "encoder_prompt_filling_the_budget_exactly": (
        _cfg(max_num_batched_tokens=10, enable_chunked_prefill=False),
        [Arrival(0, 10), Arrival(1, 1)],
        [[C(0, 0, 10, True, 0)], [C(1, 0, 1, True, 0)]],
    ),
    "encoder_ignores_the_chunk_threshold": (
        _cfg(
            max_num_batched_tokens=10, long_prefill_token_threshold=2, enable_chunked_prefill=False
        ),
        [Arrival(0, 6), Arrival(1, 4)],
        [[C(0, 0, 6, True, 0), C(1, 0, 4, True, 0)]],
    ),
    "max_num_seqs_bounds_a_step": (
        _cfg(max_num_batched_tokens=100, max_num_seqs=2),
        [Arrival(i, 1) for i in range(5)],
        [
            [C(0, 0, 1, True, 0), C(1, 0, 1, True, 0)],
            [C(2, 0, 1, True, 0), C(3, 0, 1, True, 0)],
            [C(4, 0, 1, True, 0)],
        ],
    ),
    "max_num_seqs_counts_the_running_prefill": (
        _cfg(max_num_batched_tokens=10, max_num_seqs=1),
        [Arrival(0, 15), Arrival(1, 3)],
        [[C(0, 0, 10, False, 1)], [C(0, 10, 5, True, 0)], [C(1, 0, 3, True, 0)]],
    ),
    "priority_orders_the_waiting_queue_then_arrival": (
        _cfg(max_num_batched_tokens=10),
        [Arrival(0, 5, priority=1), Arrival(1, 5), Arrival(2, 5), Arrival(3, 5, priority=1)],
        [[C(1, 0, 5, True, 0), C(2, 0, 5, True, 0)], [C(0, 0, 5, True, 0), C(3, 0, 5, True, 0)]],
    ),
    "blocks_needed_rounds_up_over_all_but_the_last_token": (
        _cfg(max_num_batched_tokens=10),
        [Arrival(0, 17), Arrival(1, 18, at_step=2)],
        [
            [C(0, 0, 10, False, 1)],
            [C(0, 10, 7, True, 0)],
            [C(1, 0, 10, False, 2)],
            [C(1, 10, 8, True, 0)],
        ],
    ),
}


@pytest.mark.parametrize("name", sorted(MULTI_STEP_CASES))
def test_multi_step_tables(name: str) -> None:
    config, arrivals, expected = MULTI_STEP_CASES[name]
    assert run_steps(arrivals, config) == [tuple(step) for step in expected]


def _seq(rid: int, prompt: int, computed: int = 0, held: int = 0, arrival: int = 0) -> PlannerSeq:
    return PlannerSeq(rid, prompt, computed, held, arrival_index=arrival)


SINGLE_STEP_CASES = {
    "running_first_takes_the_whole_budget": (
        _cfg(max_num_batched_tokens=12),
        64,
        [_seq(1, 8, arrival=1)],
        [_seq(5, 30, computed=10, held=2, arrival=5)],
        [C(5, 10, 12, False, 0)],
    ),
    "running_finishes_then_waiting_starts_a_chunk": (
        _cfg(max_num_batched_tokens=24),
        64,
        [_seq(1, 8, arrival=1)],
        [_seq(5, 30, computed=10, held=2, arrival=5)],
        [C(5, 10, 20, True, 0), C(1, 0, 4, False, 1)],
    ),
    "running_tops_up_a_short_reservation": (
        _cfg(max_num_batched_tokens=8),
        64,
        [],
        [_seq(3, 40, computed=8, held=1)],
        [C(3, 8, 8, False, 2)],
    ),
    "whole_prompt_needs_no_blocks": (
        _cfg(max_num_batched_tokens=10),
        0,
        [_seq(0, 10)],
        [],
        [C(0, 0, 10, True, 0)],
    ),
    "chunked_prompt_without_enough_blocks_waits_and_blocks_those_behind": (
        _cfg(max_num_batched_tokens=10, block_size=4, num_kv_blocks=8),
        4,
        [_seq(0, 8, arrival=0), _seq(1, 20, arrival=1), _seq(2, 1, arrival=2)],
        [],
        [C(0, 0, 8, True, 0)],
    ),
    "chunked_prompt_with_enough_blocks_starts": (
        _cfg(max_num_batched_tokens=10, block_size=4, num_kv_blocks=8),
        5,
        [_seq(0, 8, arrival=0), _seq(1, 20, arrival=1), _seq(2, 1, arrival=2)],
        [],
        [C(0, 0, 8, True, 0), C(1, 0, 2, False, 5)],
    ),
    "head_waiting_for_blocks_stops_a_prompt_that_would_fit": (
        _cfg(max_num_batched_tokens=10, block_size=4, num_kv_blocks=8),
        0,
        [_seq(0, 20, arrival=0), _seq(1, 3, arrival=1)],
        [],
        [],
    ),
    "two_new_prefills_do_not_share_the_same_free_blocks": (
        _cfg(
            max_num_batched_tokens=10, long_prefill_token_threshold=5, block_size=4, num_kv_blocks=8
        ),
        5,
        [_seq(0, 13, arrival=0), _seq(1, 13, arrival=1)],
        [],
        [C(0, 0, 5, False, 3)],
    ),
}


@pytest.mark.parametrize("name", sorted(SINGLE_STEP_CASES))
def test_single_step_tables(name: str) -> None:
    config, free, waiting, running, expected = SINGLE_STEP_CASES[name]
    plan = plan_step(waiting, running, config, free)
    assert plan.chunks == tuple(expected)
    assert plan.num_tokens == sum(chunk.num_tokens for chunk in expected)
    assert plan.is_empty == (not expected)


@pytest.mark.parametrize(
    ("num_prompt_tokens", "block_size", "expected"),
    [(1, 16, 0), (2, 16, 1), (16, 16, 1), (17, 16, 1), (18, 16, 2), (95, 16, 6), (5, 1, 4)],
)
def test_blocks_needed(num_prompt_tokens: int, block_size: int, expected: int) -> None:
    assert blocks_needed(num_prompt_tokens, block_size) == expected


def test_chunk_properties() -> None:
    chunk = C(7, 32, 10, False, 0)
    assert (chunk.write_kv, chunk.context_len, chunk.end) == (True, 32, 42)
    assert not C(7, 42, 3, True, 0).write_kv


@pytest.mark.parametrize(
    ("config", "expected"),
    [
        (_cfg(max_num_batched_tokens=10, enable_chunked_prefill=False), 10),
        (_cfg(max_num_batched_tokens=10, block_size=4, num_kv_blocks=4), 17),  # 4 blocks x 4 + 1
        (_cfg(max_num_batched_tokens=64, block_size=4, num_kv_blocks=4), 64),  # runs whole
    ],
)
def test_max_prompt_tokens(config: SchedulerConfig, expected: int) -> None:
    assert max_prompt_tokens(config) == expected
    assert plan_step([_seq(0, expected)], [], config, config.num_kv_blocks).chunks
    with pytest.raises(PromptTooLongError) as info:
        plan_step([_seq(1, expected + 1)], [], config, config.num_kv_blocks)
    assert info.value.request_id == 1


@pytest.mark.parametrize(
    "kwargs",
    [
        {"max_num_batched_tokens": 0},
        {"max_num_seqs": -1},
        {"block_size": 0},
        {"num_kv_blocks": 0},
        {"max_num_queued_tokens": 0},
        {"max_num_queued_requests": 0},
        {"long_prefill_token_threshold": 0},
        {"long_prefill_token_threshold": 4097},
        {"max_num_batched_tokens": 2.5},
    ],
)
def test_config_rejects_bad_values(kwargs: dict[str, object]) -> None:
    with pytest.raises(ValueError, match="SchedulerConfig"):
        SchedulerConfig(**kwargs)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    "args",
    [(0, 0, 0, 0), (0, 5, 5, 0), (0, 5, -1, 0), (0, 5, 0, -1)],
)
def test_planner_seq_rejects_impossible_states(args: tuple[int, int, int, int]) -> None:
    with pytest.raises(ValueError):
        PlannerSeq(*args)


def _random_config(rng: random.Random) -> SchedulerConfig:
    budget = rng.randint(1, 48)
    return SchedulerConfig(
        max_num_batched_tokens=budget,
        max_num_seqs=rng.randint(1, 6),
        long_prefill_token_threshold=rng.choice([None, rng.randint(1, budget)]),
        block_size=rng.randint(1, 8),
        num_kv_blocks=rng.randint(1, 24),
        enable_chunked_prefill=rng.random() < 0.8,
    )


def _check_step(
    harness: Harness, plan: BatchPlan, before: list[PlannerSeq], num_running: int
) -> None:
    """Invariants of one applied plan, checked against the rules."""
    config = harness.config
    assert plan.num_tokens == sum(c.num_tokens for c in plan.chunks)
    assert plan.num_tokens <= config.max_num_batched_tokens
    assert len(plan.chunks) <= config.max_num_seqs
    ids = [c.request_id for c in plan.chunks]
    assert len(set(ids)) == len(ids)
    # running prompts first (in queue order), then a prefix of the ordered waiting queue
    ordered = sorted(before[:num_running], key=lambda s: (s.priority, s.arrival_index))
    ordered += sorted(before[num_running:], key=lambda s: (s.priority, s.arrival_index))
    assert ids == [s.request_id for s in ordered[: len(ids)]]
    live = {r.arrival.request_id: r for r in harness.running}
    for chunk in plan.chunks:
        seq = next(s for s in before if s.request_id == chunk.request_id)
        assert chunk.is_last == (chunk.end == seq.num_prompt_tokens)
        if config.enable_chunked_prefill:
            assert chunk.num_tokens <= config.max_chunk_tokens
        else:
            assert chunk.start == 0 and chunk.is_last
        if chunk.start == 0 and chunk.is_last:
            assert chunk.num_new_blocks == 0  # a prompt done in one step never writes KV
        if chunk.write_kv:  # its keys and values fit the blocks it holds, which never exceed need
            held = len(live[chunk.request_id].block_ids)
            assert chunk.end <= held * config.block_size
            assert held == blocks_needed(seq.num_prompt_tokens, config.block_size)
    for request in harness.running:
        assert len(request.block_ids) <= blocks_needed(
            request.arrival.num_prompt_tokens, config.block_size
        )
    allocator = harness.allocator
    assert allocator.num_used == sum(len(r.block_ids) for r in harness.running)
    assert allocator.num_used + allocator.num_free == allocator.num_total


@pytest.mark.parametrize("seed", range(40))
def test_simulation_random_workloads(seed: int) -> None:
    rng = random.Random(seed)
    config = _random_config(rng)
    longest = min(max_prompt_tokens(config), 120)
    arrivals = [
        Arrival(rid, rng.randint(1, longest), rng.randint(0, 2), rng.randint(0, 30))
        for rid in range(rng.randint(1, 40))
    ]
    harness = Harness(config)
    num_steps = 0
    while len(harness.finished) < len(arrivals):
        for arrival in arrivals:
            if arrival.at_step == num_steps:
                harness.arrive(arrival)
        before = [r.view() for r in harness.running + harness.waiting]
        num_running = len(harness.running)
        plan = harness.step()
        _check_step(harness, plan, before, num_running)
        assert plan.chunks or not before  # progress whenever anything is queued
        num_steps += 1
        assert num_steps <= 31 + sum(a.num_prompt_tokens for a in arrivals)
    assert harness.allocator.num_free == config.num_kv_blocks
    for arrival in arrivals:  # chunks covered each prompt exactly once, in order
        spans = harness.finished[arrival.request_id].spans
        assert [s for s, _ in spans] == [0] + [e for _, e in spans[:-1]]
        assert spans[-1][1] == arrival.num_prompt_tokens


def _bg(rid: int, prompt: int, computed: int = 0, held: int = 0, arrival: int = 0) -> PlannerSeq:
    """A background prompt (a batch line's)."""
    return PlannerSeq(rid, prompt, computed, held, BACKGROUND_PRIORITY, arrival)


SHARED = 10 * BACKGROUND_SHARE  # a budget whose background share is 10 tokens
BACKGROUND_CASES = {
    "interactive_work_keeps_background_out_of_the_step": (
        _cfg(max_num_batched_tokens=SHARED, enable_chunked_prefill=False),
        [_bg(0, 4, arrival=0), _seq(1, 4, arrival=1), _bg(2, 4, arrival=2)],
        [],
        [C(1, 0, 4, True, 0)],
    ),
    "a_started_background_prefill_waits_for_interactive_work": (
        _cfg(max_num_batched_tokens=SHARED),
        [_seq(1, 20, arrival=1)],
        [_bg(0, 200, computed=10, held=13, arrival=0)],
        [C(1, 0, 20, True, 0)],
    ),
    "background_alone_takes_its_share_of_the_budget": (
        _cfg(max_num_batched_tokens=SHARED, enable_chunked_prefill=False),
        [_bg(0, 4, arrival=0), _bg(1, 4, arrival=1), _bg(2, 4, arrival=2)],
        [],
        [C(0, 0, 4, True, 0), C(1, 0, 4, True, 0)],
    ),
    "a_background_prompt_above_the_share_runs_whole_and_alone": (
        _cfg(max_num_batched_tokens=SHARED, enable_chunked_prefill=False),
        [_bg(0, 30, arrival=0), _bg(1, 2, arrival=1)],
        [],
        [C(0, 0, 30, True, 0)],
    ),
    "a_chunked_background_prompt_runs_in_chunks_of_the_share": (
        _cfg(max_num_batched_tokens=SHARED),
        [_bg(0, 95, arrival=0)],
        [],
        [C(0, 0, 10, False, 6)],
    ),
}


@pytest.mark.parametrize("name", sorted(BACKGROUND_CASES))
def test_background_prompts_take_only_what_interactive_work_leaves(name: str) -> None:
    config, waiting, running, expected = BACKGROUND_CASES[name]
    plan = plan_step(waiting, running, config, config.num_kv_blocks)
    assert plan.chunks == tuple(expected)
    assert plan.background == all(seq.priority == BACKGROUND_PRIORITY for seq in waiting + running)


# ---- the vision tower's work: the patches of the images a step first reaches count in its budget


def _vl(rid: int, tokens: int, images: tuple[ImageRun, ...], computed: int = 0) -> PlannerSeq:
    return PlannerSeq(rid, tokens, computed, 0, arrival_index=rid, images=images)


def test_a_chunk_stops_before_an_image_the_budget_cannot_take() -> None:
    # two images of 60 patches (15 tokens each) in a 64-token prompt; budget 100 a step
    seq = _vl(0, 64, (ImageRun(4, 19, 60), ImageRun(30, 45, 60)))
    plan = plan_step([seq], [], _cfg(max_num_batched_tokens=100), 64)
    assert plan.chunks == (C(0, 0, 30, False, 4),)  # 30 tokens + 60 patches; not the second
    assert plan.num_tokens == 30  # the prompts' tokens, not the patches
    # the next step starts at that image: it runs now (34 tokens + 60 patches)
    later = _vl(0, 64, seq.images, computed=30)
    plan = plan_step([], [later], _cfg(max_num_batched_tokens=100), 64)
    assert plan.chunks == (C(0, 30, 34, True, 0),)


def test_a_chunk_takes_fewer_tokens_to_make_room_for_its_image() -> None:
    seq = _vl(0, 64, (ImageRun(2, 10, 32),))
    plan = plan_step([seq], [], _cfg(max_num_batched_tokens=48), 64)
    assert plan.chunks == (C(0, 0, 16, False, 4),)  # 16 tokens + 32 patches


def test_an_image_above_the_whole_budget_runs_alone_and_fills_its_step() -> None:
    config = _cfg(max_num_batched_tokens=64)
    big = _vl(0, 40, (ImageRun(2, 30, 400),))  # 400 patches against a budget of 64
    other = _vl(1, 20, (ImageRun(1, 5, 16),))
    text = _vl(2, 8, ())
    plan = plan_step([big, other, text], [], config, 64)
    # the text before the big image first, beside the others; the image waits for its own step
    assert plan.chunks == (C(0, 0, 2, False, 3), C(1, 0, 20, True, 0), C(2, 0, 8, True, 0))
    plan = plan_step([text], [_vl(0, 40, big.images, computed=2)], config, 64)
    assert plan.chunks == (C(0, 2, 28, False, 3),)  # its tokens, alone: the text waits
    plan = plan_step([text], [_vl(0, 40, big.images, computed=30)], config, 64)
    assert plan.chunks == (C(0, 30, 10, True, 0), C(2, 0, 8, True, 0))


def test_a_running_prompt_inside_an_image_charges_nothing_for_it() -> None:
    started = _vl(0, 40, (ImageRun(0, 32, 128),), computed=16)  # its first chunk ran the image
    beside = _vl(1, 20, (ImageRun(2, 10, 32),))
    plan = plan_step([beside], [started], _cfg(max_num_batched_tokens=40), 64)
    assert plan.chunks == (C(0, 16, 24, True, 0), C(1, 0, 2, False, 2))  # up to its image


def test_a_prompt_starting_inside_an_image_after_cache_hits_runs_that_image() -> None:
    hits = _vl(0, 40, (ImageRun(0, 32, 128),), computed=16)  # waiting: cached up to 16
    beside = _vl(1, 20, (ImageRun(2, 10, 32),))
    plan = plan_step([hits, beside], [], _cfg(max_num_batched_tokens=200), 64)
    # 24 tokens + 128 patches, then 16 tokens + 32 patches: 200
    assert plan.chunks == (C(0, 16, 24, True, 0), C(1, 0, 16, False, 2))
    plan = plan_step([hits, beside], [], _cfg(max_num_batched_tokens=150), 64)
    assert plan.chunks == (C(0, 16, 22, False, 3),)  # 22 tokens + 128 patches: full


def test_a_whole_prompt_with_its_images_runs_if_they_fit_or_alone() -> None:
    config = _cfg(max_num_batched_tokens=200, enable_chunked_prefill=False)
    first = _vl(0, 30, (ImageRun(1, 20, 76),))
    second = _vl(1, 30, (ImageRun(1, 20, 76),))
    text = _vl(2, 30, ())
    plan = plan_step([first, second, text], [], config, 64)
    assert plan.chunks == (C(0, 0, 30, True, 0),)  # 106; the second (106) waits, the text too
    plan = plan_step([second, text], [], config, 64)
    assert plan.chunks == (C(1, 0, 30, True, 0), C(2, 0, 30, True, 0))
    small = _cfg(max_num_batched_tokens=100, enable_chunked_prefill=False)
    plan = plan_step([second, text], [], small, 64)
    assert plan.chunks == (C(1, 0, 30, True, 0),)  # 106 > 100: alone, and the step is full
