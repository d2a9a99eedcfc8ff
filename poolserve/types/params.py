"""The frozen per-request pooling parameters."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Protocol, Self, TypeVar

from poolserve.types.tasks import TOKEN_LEVEL_TASKS, PoolingTask


class Logits(Protocol):
    """What calibration needs of logits: a torch tensor in the engine, any array elsewhere."""

    def __sub__(self, other: float, /) -> Self: ...

    def __truediv__(self, other: float, /) -> Self: ...


T = TypeVar("T", bound=Logits)


@dataclass(frozen=True)
class PoolingParams:
    """Per-request pooling parameters; None means the model's default."""

    task: PoolingTask
    dimensions: int | None = None
    normalize: bool | None = None
    use_activation: bool | None = None
    step_tag_id: int | None = None
    returned_token_ids: tuple[int, ...] | None = None
    # leading tokens of a sentence-transformers prompt that CLS and MEAN pooling pass over, as
    # its Pooling does with include_prompt: false
    prompt_tokens: int | None = None
    # late chunking: for each prompt these parameters are submitted with, in order, its token
    # ranges [start, end); each range is mean-pooled into one row of that prompt's output
    # (`[num_spans, dim]`). The engine hands each prompt its own entry (validation.py).
    token_spans: tuple[tuple[tuple[int, int], ...], ...] | None = None
    # the LoRA adapter the prompt runs through, by name (jina-embeddings-v3's task: one of the
    # model's `lora_adaptations`); None: none, the base model
    adapter: str | None = None

    @property
    def is_token_level(self) -> bool:
        """Whether the output grows with the prompt (one entry per token)."""
        return self.task in TOKEN_LEVEL_TASKS


@dataclass(frozen=True)
class LogitCalibration:
    """vLLM's `logit_mean` and `logit_sigma`: classifier logits become `(logit - mean) / sigma`
    before any activation (a model-level setting, the same for every request)."""

    mean: float | None = None
    sigma: float | None = None

    def __post_init__(self) -> None:
        for name, value in (("logit_mean", self.mean), ("logit_sigma", self.sigma)):
            if value is not None and not math.isfinite(value):
                raise ValueError(f"{name} must be a finite number, got {value}")
        if self.sigma == 0:
            raise ValueError("logit_sigma cannot be 0 (division by zero)")

    def __call__(self, logits: T) -> T:
        """The calibrated logits (the same tensor when nothing is set)."""
        if self.mean is not None:
            logits = logits - self.mean
        if self.sigma is not None:
            logits = logits / self.sigma
        return logits


NO_CALIBRATION = LogitCalibration()
