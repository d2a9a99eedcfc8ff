"""Prefix cache and the planner's cache rules: refcounts, LRU reuse, hashes, hits (no torch)."""

from __future__ import annotations

import numpy as np
import pytest

from poolserve.engine.sched.planner import (
    PlannerSeq,
    ScheduledChunk,
    max_hit_blocks,
    num_cacheable_blocks,
    plan_step,
)
from poolserve.engine.sched.prefix_cache import PrefixCache, extend_block_hashes
from poolserve.types.errors import BlockFreeError, NoFreeBlocksError
from poolserve.types.limits import SchedulerConfig

C = ScheduledChunk  # C(request_id, start, num_tokens, is_last, new_blocks, donated_tokens)


def _ids(*values: int) -> np.ndarray:
    return np.asarray(values, dtype=np.int64)


def _hashes(n: int) -> list[bytes]:
    return [bytes([i]) * 16 for i in range(n)]


def block_hashes(token_ids: np.ndarray, block_size: int, num_blocks: int) -> list[bytes]:
    hashes: list[bytes] = []
    extend_block_hashes(hashes, token_ids, block_size, num_blocks)
    return hashes


def test_block_hashes_are_chained_over_full_blocks() -> None:
    a = block_hashes(_ids(1, 2, 3, 4, 5), block_size=2, num_blocks=2)
    b = block_hashes(_ids(1, 2, 3, 4, 9), block_size=2, num_blocks=2)
    c = block_hashes(_ids(9, 2, 3, 4), block_size=2, num_blocks=2)
    assert len(a) == 2 and a == b  # the partial tail is not hashed
    assert a[0] != c[0] and a[1] != c[1]  # an earlier token changes every later block's hash
    assert block_hashes(_ids(3, 4), 2, 1)[0] != a[1]  # same tokens, other position


def test_block_hashes_extend_where_they_stopped() -> None:
    ids = _ids(*range(1, 10))
    hashes = block_hashes(ids, 2, 1)
    extend_block_hashes(hashes, ids, 2, 3)
    extend_block_hashes(hashes, ids, 2, 2)  # already there: nothing changes
    assert hashes == block_hashes(ids, 2, 3)
    with pytest.raises(ValueError):
        extend_block_hashes(hashes, ids, 2, 5)  # 9 tokens: the fifth block is partial


def test_free_keeps_registered_blocks_cached_and_free() -> None:
    cache = PrefixCache(4, block_size=2)
    held = cache.allocate(3)
    assert cache.register(held[0], b"a" * 16) and cache.register(held[1], b"b" * 16)
    cache.free(held)
    assert (cache.num_used, cache.num_free, cache.num_cached, cache.num_cached_free) == (0, 4, 2, 2)
    assert [cache.find(h) for h in (b"a" * 16, b"b" * 16, b"c" * 16)] == [*held[:2], None]
    assert all(cache.refcount(b) == 0 for b in range(4))


def test_share_holds_a_free_cached_block_and_free_returns_it() -> None:
    cache = PrefixCache(3, block_size=2)
    (block,) = cache.allocate(1)
    cache.register(block, b"a" * 16)
    cache.free([block])
    assert cache.num_free_among([block]) == 1
    cache.share([block])
    cache.share([block])
    assert (cache.refcount(block), cache.num_free, cache.num_cached_free) == (2, 2, 0)
    assert cache.num_free_among([block]) == 0
    cache.free([block, block])
    assert (cache.refcount(block), cache.num_free, cache.num_cached_free) == (0, 3, 1)
    with pytest.raises(BlockFreeError):
        cache.free([block])


def test_allocation_uses_uncached_blocks_first_then_evicts_least_recently_freed() -> None:
    cache = PrefixCache(4, block_size=2)
    first, second = cache.allocate(2), cache.allocate(2)
    for block, name in zip(first + second, _hashes(4), strict=True):
        cache.register(block, name)
    cache.free(first)  # freed in reverse: first[1] is evicted before first[0]
    cache.free(second)
    assert cache.num_evictions == 0
    taken = cache.allocate(3)
    assert taken == [first[1], first[0], second[1]] and cache.num_evictions == 3
    assert cache.num_cached == 1 and cache.find(_hashes(4)[2]) == second[0]
    assert cache.find(_hashes(4)[3]) is None
    with pytest.raises(NoFreeBlocksError):
        cache.allocate(2)
    assert cache.num_used == 3  # nothing was handed out by the refused call


def test_uncached_free_blocks_go_before_cached_ones() -> None:
    cache = PrefixCache(3, block_size=2)
    blocks = cache.allocate(3)
    cache.register(blocks[0], b"a" * 16)
    cache.free(blocks)
    assert sorted(cache.allocate(2)) == sorted(blocks[1:])
    assert cache.num_evictions == 0 and cache.find(b"a" * 16) == blocks[0]


def test_a_twin_block_is_not_registered_and_frees_uncached() -> None:
    cache = PrefixCache(2, block_size=2)
    a, b = cache.allocate(2)
    assert cache.register(a, b"x" * 16)
    assert not cache.register(b, b"x" * 16)  # computed alongside: the first one is kept
    assert not cache.register(a, b"y" * 16)  # a block is registered once
    cache.free([a, b])
    assert (cache.num_cached, cache.num_cached_free, cache.num_free) == (1, 1, 2)


def test_refusals_leave_the_pool_untouched() -> None:
    cache = PrefixCache(2, block_size=2)
    (block,) = cache.allocate(1)
    with pytest.raises(BlockFreeError):
        cache.free([block, 7])
    with pytest.raises(BlockFreeError):
        cache.free([block, block])
    with pytest.raises(BlockFreeError):
        cache.share([block])  # not cached
    with pytest.raises(BlockFreeError):
        cache.register(1, b"z" * 16)  # not held
    assert cache.refcount(block) == 1 and cache.num_used == 1


def test_counters() -> None:
    cache = PrefixCache(2, block_size=4)
    cache.record_lookup(8, 11)
    cache.record_lookup(0, 5)
    assert (cache.num_hit_tokens, cache.num_miss_tokens) == (8, 8)


@pytest.mark.parametrize(
    ("num_prompt_tokens", "block_size", "cacheable", "hit_limit"),
    [(1, 4, 0, 0), (4, 4, 1, 0), (5, 4, 1, 1), (8, 4, 2, 1), (9, 4, 2, 2), (5, 1, 4, 4)],
)
def test_block_arithmetic(
    num_prompt_tokens: int, block_size: int, cacheable: int, hit_limit: int
) -> None:
    assert num_cacheable_blocks(num_prompt_tokens, block_size) == cacheable
    assert max_hit_blocks(num_prompt_tokens, block_size) == hit_limit


def _cfg(**kwargs: object) -> SchedulerConfig:
    return SchedulerConfig(**{"block_size": 4, "num_kv_blocks": 16, **kwargs})  # type: ignore[arg-type]


def _sharing(rid: int, tokens: int, hits: int = 0, reused: int = 0) -> PlannerSeq:
    return PlannerSeq(
        rid,
        tokens,
        hits * 4,
        hits,
        arrival_index=rid,
        caches_prefix=True,
        num_reused_free_blocks=reused,
    )


def test_a_sharing_prompt_starts_after_its_hits_and_stores_its_full_blocks() -> None:
    plan = plan_step([_sharing(0, 18, hits=2, reused=1)], [], _cfg(), 16)
    # blocks 2 and 3 are new; tokens 8..15 fill them; 16 and 17 (a partial block) are not stored
    assert plan.chunks == (C(0, 8, 10, True, 2, 8),)
    assert plan.chunks[0].num_kv_tokens == 8 and plan.chunks[0].write_kv


def test_a_prompt_inside_its_hits_stores_nothing_more() -> None:
    plan = plan_step([_sharing(0, 9, hits=2)], [], _cfg(), 16)
    assert plan.chunks == (C(0, 8, 1, True, 0, 0),)
    assert not plan.chunks[0].write_kv


def test_a_last_chunk_short_of_blocks_runs_without_storing() -> None:
    # two free blocks: the first prompt stores its two, the second (three) cannot and runs anyway
    plan = plan_step([_sharing(0, 8), _sharing(1, 12)], [], _cfg(), 2)
    assert plan.chunks == (C(0, 0, 8, True, 2, 8), C(1, 0, 12, True, 0, 0))


def test_reused_free_hits_use_free_blocks_and_wait_when_short() -> None:
    seqs = [_sharing(0, 9, hits=2, reused=2), _sharing(1, 9, hits=2, reused=2)]
    plan = plan_step(seqs, [], _cfg(), 3)
    assert plan.chunks == (C(0, 8, 1, True, 0, 0),)  # the second would need 2 of the 1 left


def test_a_chunked_sharing_prompt_reserves_as_before_and_stores_on_its_last_chunk() -> None:
    config = _cfg(max_num_batched_tokens=8)
    first = plan_step([_sharing(0, 18, hits=1)], [], config, 16)
    assert first.chunks == (C(0, 4, 8, False, 4, 0),)  # blocks_needed(18) = 5, one is a hit
    running = PlannerSeq(0, 18, 12, 5, caches_prefix=True)
    assert plan_step([], [running], config, 12).chunks == (C(0, 12, 6, True, 0, 4),)


def test_planner_seq_refuses_more_reused_blocks_than_held() -> None:
    with pytest.raises(ValueError):
        PlannerSeq(0, 10, 4, 1, num_reused_free_blocks=2)
