"""KV block allocator: counts, all-or-nothing allocate and free, and refusal of bad frees."""

from __future__ import annotations

import random

import pytest

from poolserve.engine.sched.kv_blocks import BlockAllocator
from poolserve.types.errors import BlockFreeError, NoFreeBlocksError


def test_fresh_pool_counts_and_allocate() -> None:
    allocator = BlockAllocator(8)
    assert (allocator.num_total, allocator.num_free, allocator.num_used) == (8, 8, 0)
    first = allocator.allocate(3)
    second = allocator.allocate(5)
    assert sorted(first + second) == list(range(8))
    assert (allocator.num_free, allocator.num_used) == (0, 8)
    assert allocator.allocate(0) == []


def test_allocate_beyond_free_raises_and_hands_out_nothing() -> None:
    allocator = BlockAllocator(4)
    allocator.allocate(3)
    with pytest.raises(NoFreeBlocksError) as info:
        allocator.allocate(2)
    assert (info.value.num_requested, info.value.num_free) == (2, 1)
    assert allocator.num_free == 1
    with pytest.raises(NoFreeBlocksError):
        BlockAllocator(0).allocate(1)
    with pytest.raises(ValueError):
        allocator.allocate(-1)


def test_free_returns_blocks_for_reuse() -> None:
    allocator = BlockAllocator(4)
    held = allocator.allocate(4)
    allocator.free(held[:2])
    assert (allocator.num_free, allocator.num_used) == (2, 2)
    assert sorted(allocator.allocate(2)) == sorted(held[:2])


@pytest.mark.parametrize(
    "bad_free",
    [[0], [7], [-1], [1, 1], [1, 2, 1], [1, 99]],
    ids=["never_allocated", "out_of_range", "negative", "duplicate", "duplicate_later", "foreign"],
)
def test_bad_free_is_refused_whole(bad_free: list[int]) -> None:
    allocator = BlockAllocator(4)
    allocator.allocate(4)
    allocator.free([0])
    with pytest.raises(BlockFreeError):
        allocator.free(bad_free)
    assert allocator.num_free == 1  # nothing of the refused call was freed
    allocator.free([1, 2, 3])
    assert allocator.num_free == 4


def test_double_free_across_calls() -> None:
    allocator = BlockAllocator(2)
    held = allocator.allocate(2)
    allocator.free(held)
    with pytest.raises(BlockFreeError):
        allocator.free(held[:1])


def test_random_allocate_free_never_hands_out_a_held_block() -> None:
    rng = random.Random(0)
    allocator = BlockAllocator(32)
    owners: list[list[int]] = []
    for _ in range(2000):
        if owners and rng.random() < 0.5:
            allocator.free(owners.pop(rng.randrange(len(owners))))
        else:
            want = rng.randint(0, 8)
            if want > allocator.num_free:
                with pytest.raises(NoFreeBlocksError):
                    allocator.allocate(want)
                continue
            owners.append(allocator.allocate(want))
        held = [block for blocks in owners for block in blocks]
        assert len(set(held)) == len(held) == allocator.num_used
        assert all(0 <= block < 32 for block in held)
        assert allocator.num_used + allocator.num_free == 32
