"""What the engine hands back for one finished request: its pooled output and its timings."""

from __future__ import annotations

from collections.abc import Sequence
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


# Output.PARTS: several 2-D float32 arrays of one prompt in one flat buffer, so one request
# carries them over the socket as any output: [k, rows_1, cols_1, ..., rows_k, cols_k, then each
# array's values in order]. The sizes are exact in float32 (below 2**24).


def parts_header(shapes: Sequence[tuple[int, int]]) -> list[float]:
    """The buffer's head for arrays of these shapes: their count, then each one's rows, cols."""
    return [float(len(shapes)), *(float(n) for shape in shapes for n in shape)]


def unpack_parts(data: np.ndarray) -> tuple[np.ndarray, ...]:
    """The arrays a PARTS output holds, in order (views of `data`)."""
    flat = data.reshape(-1)
    count = int(flat[0])
    sizes = flat[1 : 1 + 2 * count].astype(np.int64).reshape(count, 2)
    parts, start = [], 1 + 2 * count
    for rows, cols in sizes:
        parts.append(flat[start : start + rows * cols].reshape(rows, cols))
        start += int(rows * cols)
    return tuple(parts)
