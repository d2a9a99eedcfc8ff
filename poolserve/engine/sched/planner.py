"""Pure batch planner: (waiting, running, budgets, free blocks) -> BatchPlan.

Rules, in order:
- partial prefills (`running`) continue before any new prompt is admitted;
- both queues are ordered by (priority, arrival_index), lower first;
- a step holds at most `max_num_batched_tokens` tokens and `max_num_seqs` chunks;
- with chunked prefill a prompt takes at most `config.max_chunk_tokens` tokens per step;
  without it (encoders) a prompt runs whole or waits;
- a prompt that will not finish in the step it starts reserves every KV block it can ever
  write (`blocks_needed`) at once, so a started prefill always finishes; a prompt that
  finishes in its first step needs no blocks, unless it caches its prefix: then its last chunk
  stores its full blocks' KV when those blocks are free, and runs without storing them if not;
- a waiting prompt's cache hits count as blocks it holds and as tokens already computed; those
  that sit among the free blocks now use free blocks when it starts;
- a waiting prompt that cannot run stops admission for those behind it (no overtaking),
  so a long prompt is never starved by a stream of short ones;
- a vision-language prompt's image runs through the vision tower in the step whose chunk first
  reaches its tokens, and its patches count in that step's token budget beside the tokens; a
  chunk stops before an image that does not fit (a prompt that runs whole waits), except that
  an image above the whole budget (or a whole prompt with its images) runs as a step's first
  work and fills it, so none is refused;
- background prompts (priority >= BACKGROUND_PRIORITY: batch lines) run only in steps without
  any other prompt waiting or running, and such a step takes at most 1/BACKGROUND_SHARE of the
  token budget (or one whole prompt above that, alone): an interactive prompt never shares a
  step with them and waits for at most one small step of theirs.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from itertools import chain
from operator import attrgetter

from poolserve.types.errors import PromptTooLongError
from poolserve.types.limits import BACKGROUND_PRIORITY, BACKGROUND_SHARE, SchedulerConfig

QUEUE_ORDER = attrgetter("priority", "arrival_index")  # lower first; the planner admits in it


@dataclass(frozen=True, slots=True)
class ImageRun:
    """One image inside a prompt: its placeholder tokens [start, end) and its tower's work."""

    start: int
    end: int
    num_patches: int  # what the vision tower runs over: its cost in the step's tower budget


@dataclass(frozen=True, slots=True)
class PlannerSeq:
    """The planner's view of one request."""

    request_id: int
    num_prompt_tokens: int
    num_computed_tokens: int
    num_blocks_held: int
    priority: int = 0  # lower value runs first
    arrival_index: int = 0  # ties in priority run in arrival order
    caches_prefix: bool = False  # stores every full block's KV, last chunk too, for later prompts
    # Of num_blocks_held, cached blocks not yet taken that sit among the free blocks now.
    num_reused_free_blocks: int = 0
    images: tuple[ImageRun, ...] = ()  # in prompt order; () for a text

    def __post_init__(self) -> None:
        """Refuse states that no live request can be in."""
        if not 0 <= self.num_computed_tokens < self.num_prompt_tokens:
            raise ValueError(
                f"request {self.request_id}: need 0 <= num_computed_tokens "
                f"({self.num_computed_tokens}) < num_prompt_tokens ({self.num_prompt_tokens})"
            )
        if self.num_blocks_held < 0:
            raise ValueError(f"request {self.request_id}: negative num_blocks_held")
        if not 0 <= self.num_reused_free_blocks <= self.num_blocks_held:
            raise ValueError(
                f"request {self.request_id}: need 0 <= num_reused_free_blocks <= num_blocks_held"
            )


@dataclass(frozen=True, slots=True)
class ScheduledChunk:
    """One request's slice of prompt tokens in a step."""

    request_id: int
    start: int  # == the request's num_computed_tokens when planned
    num_tokens: int
    is_last: bool
    num_new_blocks: int  # blocks the engine must allocate to this request before the forward
    # A last chunk stores no KV unless its prompt caches its prefix: then its first this many
    # tokens, which complete the prompt's full blocks.
    num_donated_tokens: int = 0

    @property
    def num_kv_tokens(self) -> int:
        """Leading tokens of the chunk whose keys and values are stored."""
        return self.num_donated_tokens if self.is_last else self.num_tokens

    @property
    def write_kv(self) -> bool:
        """Chunks followed by another chunk store KV; a last one only to donate full blocks."""
        return self.num_kv_tokens > 0

    @property
    def context_len(self) -> int:
        """Tokens of this request already in the KV cache."""
        return self.start

    @property
    def end(self) -> int:
        """One past the chunk's last prompt position."""
        return self.start + self.num_tokens


@dataclass(frozen=True, slots=True)
class BatchPlan:
    """The chunks of one step, running requests first, then new admissions."""

    chunks: tuple[ScheduledChunk, ...]
    num_tokens: int
    background: bool = False  # only background prompts (the loop plans no such step ahead)

    @property
    def is_empty(self) -> bool:
        """True when nothing can run this step."""
        return not self.chunks

    @property
    def num_new_blocks(self) -> int:
        """Blocks the whole plan asks the engine to allocate."""
        return sum(chunk.num_new_blocks for chunk in self.chunks)


def blocks_needed(num_prompt_tokens: int, block_size: int) -> int:
    """KV blocks a chunked prompt reserves: all its positions but the last one."""
    if num_prompt_tokens < 1 or block_size < 1:
        raise ValueError(
            f"need num_prompt_tokens >= 1 and block_size >= 1, got "
            f"{num_prompt_tokens}, {block_size}"
        )
    return (num_prompt_tokens - 1 + block_size - 1) // block_size


def num_cacheable_blocks(num_prompt_tokens: int, block_size: int) -> int:
    """Full blocks a prompt can store for the prefix cache: those inside its reservation."""
    return min(num_prompt_tokens // block_size, blocks_needed(num_prompt_tokens, block_size))


def max_hit_blocks(num_prompt_tokens: int, block_size: int) -> int:
    """Most cached blocks a prompt may reuse: its last token is always computed (LAST reads it)."""
    return (num_prompt_tokens - 1) // block_size


def max_prompt_tokens(config: SchedulerConfig) -> int:
    """Longest prompt the planner can ever schedule; reject longer ones at submission."""
    if not config.enable_chunked_prefill:
        return config.max_num_batched_tokens
    # a prompt runs whole when it fits one chunk, else it needs its reservation to fit the pool
    return max(config.max_chunk_tokens, config.kv_blocks * config.block_size + 1)


@dataclass(slots=True)
class _StepFill:
    """One step being filled: what is left of its budgets, and its chunks (local to one call)."""

    num_tokens: int
    num_seqs: int
    num_free_blocks: int
    max_chunk_tokens: int | None  # None: prompts run whole (no chunked prefill)
    block_size: int
    chunks: list[ScheduledChunk]

    @property
    def is_full(self) -> bool:
        """True when no further chunk can join the step."""
        return self.num_tokens == 0 or self.num_seqs == 0

    def take(self, seq: PlannerSeq, started: bool) -> bool:
        """Add `seq`'s next chunk if it can run now; False when it must wait. `started`: an
        earlier chunk of it was planned (so did the tower work of the image it reached)."""
        num_remaining = seq.num_prompt_tokens - seq.num_computed_tokens
        cap = self.max_chunk_tokens
        if cap is None:
            if num_remaining > self.num_tokens:
                return False
            num_tokens = num_remaining
        else:
            num_tokens = min(num_remaining, cap, self.num_tokens)
        num_tokens, num_patches = self._with_images(seq, num_tokens, started)
        if num_tokens == 0:
            return False
        is_last = num_tokens == num_remaining
        kv = self._kv_blocks(seq, is_last)
        if kv is None:
            return False
        num_new_blocks, num_kv_blocks = kv
        self.num_tokens -= num_tokens + num_patches
        self.num_seqs -= 1
        self.num_free_blocks -= num_new_blocks + seq.num_reused_free_blocks
        kv_end = num_kv_blocks * self.block_size  # a last chunk stores KV below this position
        donated = max(0, kv_end - seq.num_computed_tokens) if is_last else 0
        self.chunks.append(
            ScheduledChunk(
                seq.request_id,
                seq.num_computed_tokens,
                num_tokens,
                is_last,
                num_new_blocks,
                donated,
            )
        )
        return True

    def _with_images(self, seq: PlannerSeq, num_tokens: int, started: bool) -> tuple[int, int]:
        """(tokens seq's chunk may take, patches of the images it runs through the tower), the
        two together within what is left of the step's budget: the chunk stops before the first
        image that does not fit (0 tokens: it waits). An image above the whole budget, or a whole
        prompt's images, may run only as the step's first work, and then fill the step."""
        start = seq.num_computed_tokens
        end = start + num_tokens
        left = self.num_tokens
        fresh = not self.chunks
        pending = [
            image
            for image in seq.images
            # a chunk's images: not before it, and not reached (so run) by an earlier chunk; a
            # prompt that has not started after cache hits inside an image runs that image
            if start < image.end and image.start < end and not (started and image.start < start)
        ]
        num_patches = sum(image.num_patches for image in pending)
        if not pending or num_tokens + num_patches <= left:
            return num_tokens, num_patches
        if self.max_chunk_tokens is None:  # a whole prompt: alone, or it waits
            return (num_tokens, left - num_tokens) if fresh else (0, 0)
        num_patches = 0
        for image in pending:
            reach = max(image.start, start) + 1 - start  # tokens up to the image's first
            if reach + num_patches + image.num_patches <= left:
                num_patches += image.num_patches
                continue
            if fresh and num_patches == 0 and image.start <= start:
                # above the whole budget: the image (and its tokens in this chunk) alone
                taken = min(num_tokens, image.end - start)
                return taken, max(0, left - taken)
            end = image.start  # the chunk stops before it
            break
        return max(0, min(end - start, left - num_patches)), num_patches

    def _kv_blocks(self, seq: PlannerSeq, is_last: bool) -> tuple[int, int] | None:
        """(blocks to allocate, blocks the chunk may write up to) for seq's chunk; None: wait."""
        if not is_last:
            num_blocks = blocks_needed(seq.num_prompt_tokens, self.block_size)
        elif seq.caches_prefix:
            num_blocks = num_cacheable_blocks(seq.num_prompt_tokens, self.block_size)
        else:
            num_blocks = 0
        num_new_blocks = max(0, num_blocks - seq.num_blocks_held)
        num_free = self.num_free_blocks - seq.num_reused_free_blocks
        if num_new_blocks <= num_free:
            return num_new_blocks, num_blocks
        if not is_last or num_free < 0:
            return None
        # Caching is best effort: a last chunk short of blocks runs without storing its KV.
        return 0, 0


def plan_step(
    waiting: Sequence[PlannerSeq],
    running: Sequence[PlannerSeq],
    config: SchedulerConfig,
    num_free_blocks: int,
) -> BatchPlan:
    """Choose the chunks of the next step; raises PromptTooLongError for an unschedulable prompt."""
    cap = config.max_chunk_tokens if config.enable_chunked_prefill else None
    budget = config.max_num_batched_tokens
    background = False
    if any(seq.priority < BACKGROUND_PRIORITY for seq in chain(running, waiting)):
        # interactive work waits or runs: background prompts sit this step out (a started one
        # keeps its reservation and continues later)
        running = [seq for seq in running if seq.priority < BACKGROUND_PRIORITY]
        waiting = [seq for seq in waiting if seq.priority < BACKGROUND_PRIORITY]
    elif running or waiting:
        background = True
        budget = _background_budget(running, waiting, budget, cap)
    fill = _StepFill(
        budget,
        config.max_num_seqs,
        num_free_blocks,
        cap,
        config.block_size,
        [],
    )
    for seq in sorted(running, key=QUEUE_ORDER):
        if fill.is_full:
            break
        # a running prompt holds its reservation: failing to take it only means "not this step"
        fill.take(seq, started=True)
    if waiting and not fill.is_full:
        _admit_waiting(fill, waiting, max_prompt_tokens(config))
    num_tokens = sum(chunk.num_tokens for chunk in fill.chunks)  # the prompts' (no patches)
    return BatchPlan(tuple(fill.chunks), num_tokens, background)


def _background_budget(
    running: Sequence[PlannerSeq], waiting: Sequence[PlannerSeq], budget: int, cap: int | None
) -> int:
    """A step of background work alone: its share of the budget, or what the first prompt in
    order needs when it runs whole and needs more (it then runs alone)."""
    share = max(1, budget // BACKGROUND_SHARE)
    if cap is not None:  # chunked: a prompt runs in chunks of the share
        return share
    first = min(chain(running, waiting), key=QUEUE_ORDER)
    return max(share, min(budget, first.num_prompt_tokens - first.num_computed_tokens))


def _admit_waiting(fill: _StepFill, waiting: Sequence[PlannerSeq], limit: int) -> None:
    """Start waiting prompts in queue order until one must wait or the step is full."""
    for seq in sorted(waiting, key=QUEUE_ORDER):
        if fill.is_full:
            return
        if seq.num_prompt_tokens > limit:
            raise PromptTooLongError(seq.num_prompt_tokens, limit, seq.request_id)
        if not fill.take(seq, started=False):
            return  # no overtaking: those behind wait too, so this prompt is not starved
