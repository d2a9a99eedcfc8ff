"""KV block allocator: hands out integer block ids; no tensors here."""

from __future__ import annotations

from collections.abc import Iterable

from poolserve.types.errors import BlockFreeError, NoFreeBlocksError


class BlockAllocator:
    """Fixed pool of KV block ids; allocation and free are all-or-nothing."""

    def __init__(self, num_blocks: int) -> None:
        if num_blocks < 0:
            raise ValueError(f"num_blocks must be >= 0, got {num_blocks}")
        self._num_total = num_blocks
        # a stack popped from the end: fresh pools hand out 0, 1, 2, ... first
        self._free_ids: list[int] = list(range(num_blocks - 1, -1, -1))
        self._allocated = bytearray(num_blocks)  # 1 where the block is handed out

    @property
    def num_total(self) -> int:
        """Blocks in the pool."""
        return self._num_total

    @property
    def num_free(self) -> int:
        """Blocks that can be allocated now."""
        return len(self._free_ids)

    @property
    def num_used(self) -> int:
        """Blocks handed out and not yet freed."""
        return self._num_total - len(self._free_ids)

    def allocate(self, num_blocks: int) -> list[int]:
        """Hand out `num_blocks` ids, or raise NoFreeBlocksError and hand out none."""
        if num_blocks < 0:
            raise ValueError(f"cannot allocate {num_blocks} blocks")
        if num_blocks > len(self._free_ids):
            raise NoFreeBlocksError(num_blocks, len(self._free_ids))
        if num_blocks == 0:
            return []
        block_ids = self._free_ids[-num_blocks:]
        del self._free_ids[-num_blocks:]
        block_ids.reverse()
        for block_id in block_ids:
            self._allocated[block_id] = 1
        return block_ids

    def free(self, block_ids: Iterable[int]) -> None:
        """Return blocks to the pool; any bad id refuses the whole call."""
        to_free = list(block_ids)
        seen: set[int] = set()
        for block_id in to_free:
            if not 0 <= block_id < self._num_total:
                raise BlockFreeError(f"block {block_id} is not from this pool")
            if not self._allocated[block_id] or block_id in seen:
                raise BlockFreeError(f"block {block_id} is not allocated (double free)")
            seen.add(block_id)
        for block_id in to_free:
            self._allocated[block_id] = 0
        # reversed so that the next allocate() reuses them in the order given
        self._free_ids.extend(reversed(to_free))
