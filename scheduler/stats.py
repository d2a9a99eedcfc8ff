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
