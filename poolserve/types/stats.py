"""A frozen snapshot of the engine's gauges and counters, read by the metrics exporter."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass


@dataclass(frozen=True)
class EngineSnapshot:
    """Engine state at one instant."""

    num_running: int
    num_waiting: int
    num_queued_tokens: int
    num_kv_blocks_used: int
    num_kv_blocks_total: int
    num_steps: int
    step_tokens_total: int
    cloned_bytes_total: int
    num_clones: int
    num_open_poolers: int  # pooling states of requests not yet finished or released
    rejected: Mapping[str, int]
    num_kv_blocks_cached: int  # free blocks still holding a cached prefix
    prefix_cache_hit_tokens: int  # prompt tokens sharing requests found cached
    prefix_cache_miss_tokens: int  # prompt tokens sharing requests computed
    prefix_cache_evictions: int  # cached blocks reused for other work
