"""KV blocks with a prefix cache: refcounted blocks; full blocks found again by their tokens' hash.

A full block's hash covers its own tokens and, through its parent's hash, every token before it.
Under causal attention the keys and values at position p depend on tokens 0..p only, so two
prompts with equal block hashes have equal KV in those blocks, whoever computed them. A cached
block is shared read-only by every request that found it; when no request holds it, it stays
cached among the free blocks and is reused (evicted) only when an allocation finds no uncached
free block, least recently freed first.
"""

from __future__ import annotations

import enum
import hashlib
from collections import Counter, OrderedDict
from collections.abc import Iterable

import numpy as np

from poolserve.engine.sched.kv_blocks import BlockAllocator
from poolserve.types.errors import BlockFreeError, NoFreeBlocksError

HASH_BYTES = 16  # 128-bit digests: a collision would hand one prompt another's keys and values


class CacheUse(enum.Enum):
    """What one request may do with the prefix cache."""

    # caching off, an encoder or bidirectional model, or token types (KV not a function of ids)
    NONE = "none"
    # pooling reads the prefix's hidden states (MEAN, ALL, CLS, STEP, token-level tasks): it
    # computes every position, and offers the full blocks its earlier chunks wrote anyway
    DONATE = "donate"
    # pooling reads only the last position (LAST, the yes/no scorer): it starts after the cached
    # prefix it finds, and stores every full block's KV, last chunk included, for later prompts
    SHARE = "share"


def extend_block_hashes(
    hashes: list[bytes],
    token_ids: np.ndarray,
    block_size: int,
    num_blocks: int,
    images: tuple[int, bytes] | None = None,
) -> None:
    """Append chained hashes of `token_ids`' full blocks (int64) until `num_blocks` are hashed.
    `images`: where a prompt's first image placeholder sits, and its images' digest, which every
    block reaching it hashes too (placeholders are one id whatever the image)."""
    if num_blocks * block_size > len(token_ids):
        raise ValueError(f"{len(token_ids)} tokens hold fewer than {num_blocks} full blocks")
    parent = hashes[-1] if hashes else b""
    for start in range(len(hashes) * block_size, num_blocks * block_size, block_size):
        digest = hashlib.blake2b(parent, digest_size=HASH_BYTES)
        digest.update(token_ids[start : start + block_size].tobytes())
        if images is not None and start + block_size > images[0]:
            digest.update(images[1])
        parent = digest.digest()
        hashes.append(parent)


class PrefixCache:
    """The KV block pool: refcounted blocks, cached full blocks by hash, LRU reuse (loop task only).

    Every block is held (refcount >= 1), free and cached (refcount 0, hash kept, reusable on a
    hit), or free and uncached. `num_free` counts both kinds of free block: a cached one is
    evicted the moment an allocation needs it, so it never stands in the way of new work.
    """

    def __init__(self, num_blocks: int, block_size: int) -> None:
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        self.block_size = block_size
        self._uncached = BlockAllocator(num_blocks)  # ids neither held nor cached come from here
        self._refs = [0] * num_blocks
        self._block_of: dict[bytes, int] = {}
        self._hash_of: dict[int, bytes] = {}
        # Free cached blocks in the order they were freed: evicted from the front.
        self._evictable: OrderedDict[int, None] = OrderedDict()
        self.num_hit_tokens = 0
        self.num_miss_tokens = 0
        self.num_evictions = 0

    @property
    def num_total(self) -> int:
        """Blocks in the pool."""
        return self._uncached.num_total

    @property
    def num_free(self) -> int:
        """Blocks an allocation can take now: uncached ones, then cached ones by eviction."""
        return self._uncached.num_free + len(self._evictable)

    @property
    def num_used(self) -> int:
        """Blocks some request holds."""
        return self.num_total - self.num_free

    @property
    def num_cached(self) -> int:
        """Blocks findable by hash, held or free."""
        return len(self._hash_of)

    @property
    def num_cached_free(self) -> int:
        """Free blocks that still hold a cached prefix."""
        return len(self._evictable)

    def refcount(self, block_id: int) -> int:
        """Requests holding the block."""
        return self._refs[block_id]

    def allocate(self, num_blocks: int) -> list[int]:
        """Hand out `num_blocks` blocks (evicting cached ones if needed), or raise and hand none."""
        if num_blocks < 0:
            raise ValueError(f"cannot allocate {num_blocks} blocks")
        if num_blocks > self.num_free:
            raise NoFreeBlocksError(num_blocks, self.num_free)
        num_fresh = min(num_blocks, self._uncached.num_free)
        block_ids = self._uncached.allocate(num_fresh)
        block_ids += [self._evict() for _ in range(num_blocks - num_fresh)]
        for block_id in block_ids:
            self._refs[block_id] = 1
        return block_ids

    def free(self, block_ids: Iterable[int]) -> None:
        """Drop one hold on each block; any bad id refuses the whole call."""
        to_free = list(block_ids)
        for block_id, count in Counter(to_free).items():
            if not 0 <= block_id < self.num_total:
                raise BlockFreeError(f"block {block_id} is not from this pool")
            if count > self._refs[block_id]:
                raise BlockFreeError(f"block {block_id} is not held (double free)")
        uncached = []
        # Reversed: a prompt's later blocks are evicted before its earlier ones, which every
        # longer match needs first.
        for block_id in reversed(to_free):
            self._refs[block_id] -= 1
            if self._refs[block_id]:
                continue
            if block_id in self._hash_of:
                self._evictable[block_id] = None
            else:
                uncached.append(block_id)
        self._uncached.free(reversed(uncached))

    def find(self, block_hash: bytes) -> int | None:
        """The cached block holding this content, if any (no hold is taken)."""
        return self._block_of.get(block_hash)

    def num_free_among(self, block_ids: Iterable[int]) -> int:
        """How many of these cached blocks are free now (taking them uses free blocks)."""
        return sum(1 for block_id in block_ids if not self._refs[block_id])

    def share(self, block_ids: Iterable[int]) -> None:
        """Take one hold on each cached block a request found (they stay read-only)."""
        for block_id in block_ids:
            if block_id not in self._hash_of:
                raise BlockFreeError(f"block {block_id} is not cached")
            if not self._refs[block_id]:
                del self._evictable[block_id]
            self._refs[block_id] += 1

    def register(self, block_id: int, block_hash: bytes) -> bool:
        """Make a held, fully written block findable; False when that content is cached already."""
        if not self._refs[block_id]:
            raise BlockFreeError(f"block {block_id} is not held")
        if block_hash in self._block_of or block_id in self._hash_of:
            return False  # a twin computed alongside stays private and frees uncached
        self._block_of[block_hash] = block_id
        self._hash_of[block_id] = block_hash
        return True

    def record_lookup(self, num_hit_tokens: int, num_prompt_tokens: int) -> None:
        """Count a sharing request's first step: tokens found cached, and tokens it computes."""
        self.num_hit_tokens += num_hit_tokens
        self.num_miss_tokens += num_prompt_tokens - num_hit_tokens

    def _evict(self) -> int:
        """Forget the least recently freed cached block and hand out its id."""
        block_id, _ = self._evictable.popitem(last=False)
        del self._block_of[self._hash_of.pop(block_id)]
        self.num_evictions += 1
        return block_id
