"""Pooling tasks, pooling types and the frozen per-request pooling parameters."""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum, StrEnum


class PoolingTask(StrEnum):
    """What a request asks the model to produce; values are the wire names."""

    EMBED = "embed"
    CLASSIFY = "classify"
    TOKEN_EMBED = "token_embed"
    TOKEN_CLASSIFY = "token_classify"
    EMBED_TOKEN_CLASSIFY = "embed&token_classify"
    REWARD = "reward"
    SCORE = "score"  # one relevance score per (query, document) prompt
    EMBED_SPARSE = "embed_sparse"  # SPLADE over the MLM head: vocabulary ids and weights


class PoolingType(Enum):
    """How the hidden states of one request are reduced before the head."""

    CLS = "cls"
    LAST = "last"
    MEAN = "mean"
    ALL = "all"
    STEP = "step"
    SPARSE = "sparse"  # running max of MLM-head logits over non-special tokens (SPLADE)


SUPPORTED_TASKS: frozenset[PoolingTask] = frozenset(PoolingTask)

# Tasks whose output has one row (or block) per prompt token.
TOKEN_LEVEL_TASKS: frozenset[PoolingTask] = frozenset(
    {PoolingTask.TOKEN_EMBED, PoolingTask.TOKEN_CLASSIFY, PoolingTask.EMBED_TOKEN_CLASSIFY}
)


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

    @property
    def is_token_level(self) -> bool:
        """Whether the output grows with the prompt (one entry per token)."""
        return self.task in TOKEN_LEVEL_TASKS
