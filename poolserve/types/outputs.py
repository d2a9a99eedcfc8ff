"""What the engine hands back for one finished request: its pooled output and its timings."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class StepTiming:
    """One engine step that ran a chunk of a request."""

    step_index: int
    started_at: float  # time.monotonic() when the step's forward began
    duration_s: float  # forward + pooling
    num_step_tokens: int  # every request's tokens in the step
    num_step_seqs: int  # chunks in the step
    num_tokens: int  # this request's chunk


@dataclass(frozen=True)
class RequestTimeline:
    """Where a request's time went inside the engine (time.monotonic() instants)."""

    arrival_time: float
    first_scheduled_time: float
    finished_time: float
    steps: tuple[StepTiming, ...]


@dataclass(frozen=True)
class PoolingOutput:
    """One finished request: its pooled output on the host and its timings."""

    request_id: int
    data: np.ndarray  # float32, shape per task (see pooling/params.py)
    num_prompt_tokens: int
    queue_time_s: float
    inference_time_s: float
    timeline: RequestTimeline | None = None  # only when the engine records timelines
