"""Scheduler budgets, admission limits, KV geometry, async/prefix-caching/timeline switches."""

from __future__ import annotations

import math
from dataclasses import dataclass, fields, replace

# A prompt at this priority or above is background work (the Batch API's lines): it never shares
# a step with a prompt below it, and a step of background work alone takes at most
# 1/BACKGROUND_SHARE of the token budget (one whole prompt at least), so an interactive prompt
# that arrives waits for at most one such small step. Interactive requests use 0 by default.
BACKGROUND_PRIORITY = 1 << 30
BACKGROUND_SHARE = 16


@dataclass(frozen=True, slots=True)
class SchedulerConfig:
    """Every knob of the scheduler; validated on construction."""

    max_num_batched_tokens: int = 4096  # token budget of one step
    max_num_seqs: int = 256  # sequences in one step
    max_num_queued_requests: int = 1024  # admission: requests waiting + running
    max_num_queued_tokens: int = 262144  # admission: prompt tokens of unfinished requests
    long_prefill_token_threshold: int | None = None  # cap on one prompt's chunk per step
    block_size: int = 16  # KV tokens per block
    num_kv_blocks: int | None = 4096  # None: `sized` fits the model's longest prompt and a step
    enable_chunked_prefill: bool = True  # False for encoders: prompts scheduled whole
    async_scheduling: bool = True
    # Reuse cached prefix KV blocks for last-token pooling; the engine ignores it for models
    # without causal attention.
    enable_prefix_caching: bool = True
    # Keep each request's step timings in its output (tracing); off: nothing is recorded.
    record_timelines: bool = False

    def __post_init__(self) -> None:
        """Refuse non-positive sizes and a chunk cap larger than the step budget."""
        for f in fields(self):
            value = getattr(self, f.name)
            # bool is an int subclass: the switches are checked by type, not sign
            if isinstance(value, bool) or value is None:
                continue
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"SchedulerConfig.{f.name} must be a positive int, got {value!r}")
        threshold = self.long_prefill_token_threshold
        if threshold is not None and threshold > self.max_num_batched_tokens:
            raise ValueError(
                f"SchedulerConfig.long_prefill_token_threshold ({threshold}) must not exceed "
                f"max_num_batched_tokens ({self.max_num_batched_tokens})"
            )

    @property
    def max_chunk_tokens(self) -> int:
        """Most tokens one prompt may take in one step when chunking."""
        threshold = self.long_prefill_token_threshold
        return self.max_num_batched_tokens if threshold is None else threshold

    @property
    def kv_blocks(self) -> int:
        """The KV pool's blocks (a config built from the settings holds None until `sized`)."""
        if self.num_kv_blocks is None:
            raise ValueError("the KV pool is not sized: SchedulerConfig.sized() sizes it")
        return self.num_kv_blocks

    def sized(self, max_model_len: int, causal: bool) -> SchedulerConfig:
        """This config for one loaded model, what it leaves to the engine computed (once, by
        the engine): the KV pool (the longest prompt and one step when unset), chunking and
        prefix caching for causal attention only. Refuses budgets the model cannot run."""
        budget = self.max_num_batched_tokens
        if not causal and budget < max_model_len:
            raise ValueError(
                f"encoder prompts cannot be chunked: --max-num-batched-tokens ({budget}) "
                f"must be at least max_model_len ({max_model_len})"
            )
        blocks_for_longest = math.ceil(max_model_len / self.block_size)
        num_kv_blocks = self.num_kv_blocks or blocks_for_longest + math.ceil(
            budget / self.block_size
        )
        if num_kv_blocks < blocks_for_longest and causal:
            raise ValueError(
                f"--num-kv-blocks ({num_kv_blocks}) cannot hold one prompt of max_model_len "
                f"({max_model_len}); it needs at least {blocks_for_longest}"
            )
        return replace(
            self,
            num_kv_blocks=num_kv_blocks,
            enable_chunked_prefill=causal,
            # bidirectional attention: a position's KV depends on later tokens: nothing shared
            enable_prefix_caching=self.enable_prefix_caching and causal,
        )
