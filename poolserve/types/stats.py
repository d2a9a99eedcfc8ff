"""A frozen snapshot of the engine's gauges and counters, read by the metrics exporter."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass


@dataclass(frozen=True)
class LoraStats:
    """A model's LoRA adapters at one instant: what vLLM's lora_requests_info says, and the
    slots they take turns in."""

    max_loras: int  # --max-loras: adapters the model's slots hold at once
    num_loaded: int  # registered adapters (each kept in host memory, each a model name)
    num_resident: int  # adapters in the model's slots now
    evictions: int  # adapters written out of a slot to make room for another
    running: tuple[str, ...]  # adapters of requests in a step now, by name
    waiting: tuple[str, ...]  # adapters of requests waiting for their first step, by name


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
    lora: LoraStats | None = None  # None: the model serves no LoRA adapters
