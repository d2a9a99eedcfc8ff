"""Pooling methods with per-request chunk state: CLS, LAST, MEAN, ALL, STEP and span means.

Every method sees each chunk of its request in order and returns `None` until the last one.
Chunks arrive as views into the runner's persistent hidden-state buffer, which the next step
overwrites: anything kept across steps must own its storage, and a finished output that is still
a view must own its storage when it may outlive the step (async scheduling).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence

import torch

from poolserve.pooling.stats import CloneStats
from poolserve.types.errors import PoolingStateError
from poolserve.types.tasks import PoolingType


def _own(tensor: torch.Tensor, stats: CloneStats) -> torch.Tensor:
    """Give `tensor` its own storage, counted in `stats`; the one place pooling clones."""
    stats.record_clone(tensor)
    return tensor.clone()


class PoolingMethod(ABC):
    """Per-request state of one pooling method; created with the request, closed when it ends."""

    pooling_type: PoolingType

    def __init__(self, *, async_scheduling: bool, stats: CloneStats) -> None:
        # True when a finished output may still be read after the next step has started.
        self._async_scheduling = async_scheduling
        self._stats = stats

    @abstractmethod
    def add_chunk(
        self, hidden: torch.Tensor, token_ids: Sequence[int], is_last: bool
    ) -> torch.Tensor | None:
        """Consume one non-empty chunk `[n, hidden]`; the pooled states on the last chunk."""

    @abstractmethod
    def close(self) -> None:
        """Drop any state kept across chunks; idempotent."""

    def whole_prompt(self) -> PoolingType | None:
        """What this method computes of a prompt that arrives whole in one chunk, when it is
        one row or the mean of the chunk's rows and nothing was kept: several such requests are
        then pooled together (None: only chunk by chunk)."""
        return None

    def _finish_view(self, view: torch.Tensor) -> torch.Tensor:
        """A finished output that views the step buffer: owned only under async scheduling."""
        return _own(view, self._stats) if self._async_scheduling else view


class CLSPool(PoolingMethod):
    """The first token's hidden state; keeps one owned row across chunks."""

    pooling_type = PoolingType.CLS

    def __init__(self, *, async_scheduling: bool, stats: CloneStats) -> None:
        super().__init__(async_scheduling=async_scheduling, stats=stats)
        self._first: torch.Tensor | None = None  # [hidden], owned

    def whole_prompt(self) -> PoolingType | None:
        """The first row, before any chunk was seen (not a variant that skips rows)."""
        return PoolingType.CLS if type(self) is CLSPool and self._first is None else None

    def add_chunk(
        self, hidden: torch.Tensor, token_ids: Sequence[int], is_last: bool
    ) -> torch.Tensor | None:
        """Keep the first row of the first chunk; return it on the last chunk."""
        if self._first is None:
            first = hidden[0]  # [hidden], a view into the step buffer
            if is_last:
                return self._finish_view(first)
            self._first = _own(first, self._stats)
            return None
        if not is_last:
            return None
        result, self._first = self._first, None
        return result

    def close(self) -> None:
        """Drop the kept first row."""
        self._first = None


class LastPool(PoolingMethod):
    """The last token's hidden state; keeps nothing across chunks."""

    pooling_type = PoolingType.LAST

    def whole_prompt(self) -> PoolingType | None:
        """The last row."""
        return PoolingType.LAST

    def add_chunk(
        self, hidden: torch.Tensor, token_ids: Sequence[int], is_last: bool
    ) -> torch.Tensor | None:
        """Return the last row of the last chunk."""
        return self._finish_view(hidden[-1]) if is_last else None  # [hidden]

    def close(self) -> None:
        """Nothing is kept."""


class MeanPool(PoolingMethod):
    """Mean over all tokens from a float64 running sum and count, so chunking does not matter.

    float32 sums of a long prompt's rows drift with the order of the adds (1.2e-6 off the exact
    mean over 512 rows); in float64 the mean is the exact one rounded once to float32.
    """

    pooling_type = PoolingType.MEAN

    def __init__(self, *, async_scheduling: bool, stats: CloneStats) -> None:
        super().__init__(async_scheduling=async_scheduling, stats=stats)
        self._sum: torch.Tensor | None = None  # [hidden], float64, owned (a fresh reduction)
        self._count = 0

    def whole_prompt(self) -> PoolingType | None:
        """The mean of every row, before any chunk was summed (not a variant that skips rows)."""
        return PoolingType.MEAN if type(self) is MeanPool and self._sum is None else None

    def add_chunk(
        self, hidden: torch.Tensor, token_ids: Sequence[int], is_last: bool
    ) -> torch.Tensor | None:
        """Add the chunk to the running sum; return sum / count (float32) on the last chunk."""
        chunk_sum = hidden.double().sum(dim=0)  # [hidden]
        self._sum = chunk_sum if self._sum is None else self._sum + chunk_sum
        self._count += hidden.shape[0]
        if not is_last:
            return None
        mean = (self._sum / self._count).float()  # [hidden]
        self.close()
        return mean

    def close(self) -> None:
        """Drop the running sum."""
        self._sum = None
        self._count = 0


class SkipMeanPool(MeanPool):
    """Mean over the tokens after the first `skip` (a prompt sentence-transformers leaves out)."""

    def __init__(self, skip: int, *, async_scheduling: bool, stats: CloneStats) -> None:
        super().__init__(async_scheduling=async_scheduling, stats=stats)
        self._to_skip = skip  # leading tokens still to pass over

    def add_chunk(
        self, hidden: torch.Tensor, token_ids: Sequence[int], is_last: bool
    ) -> torch.Tensor | None:
        """Drop this chunk's rows still inside the prompt, then keep the running mean."""
        dropped = min(self._to_skip, hidden.shape[0])
        self._to_skip -= dropped
        kept = hidden[dropped:]  # [kept, hidden]
        if is_last and self._count + kept.shape[0] == 0:
            # everything was prompt: sentence-transformers' clamped mean is a zero vector
            self.close()
            return torch.zeros(hidden.shape[-1], dtype=torch.float32, device=hidden.device)
        return super().add_chunk(kept, token_ids[dropped:], is_last)


class SkipCLSPool(CLSPool):
    """The first token after a prompt of `skip` tokens (the first token when none is left)."""

    def __init__(self, skip: int, *, async_scheduling: bool, stats: CloneStats) -> None:
        super().__init__(async_scheduling=async_scheduling, stats=stats)
        self._position = skip  # the wanted row, counted from the prompt's first token
        self._seen = 0
        self._fallback: torch.Tensor | None = None  # [hidden], owned: row 0

    def add_chunk(
        self, hidden: torch.Tensor, token_ids: Sequence[int], is_last: bool
    ) -> torch.Tensor | None:
        """Keep the wanted row when its chunk arrives; row 0 stands in if it never does."""
        start, self._seen = self._seen, self._seen + hidden.shape[0]
        if self._first is None and start <= self._position < self._seen:
            row = hidden[self._position - start]  # [hidden], a view into the step buffer
            if is_last:
                return self._finish_view(row)
            self._first = _own(row, self._stats)
            return None
        if start == 0 and self._first is None:
            # sentence-transformers' argmax over an all-zero mask picks the first token
            self._fallback = _own(hidden[0], self._stats)
        if not is_last:
            return None
        result = self._first if self._first is not None else self._fallback
        self.close()
        return result

    def close(self) -> None:
        """Drop the kept rows."""
        super().close()
        self._fallback = None


class SpanMeanPool(PoolingMethod):
    """Late chunking: the mean of each token range `[start, end)`, `[num_spans, hidden]`.

    One float64 running sum per span (as MeanPool's) takes the rows of each chunk that fall in
    its range, so the result does not depend on how chunked prefill cuts the prompt. Every
    position is read, so the prefix cache treats it as MEAN (it computes every token, never
    starts past a hit).
    """

    pooling_type = PoolingType.MEAN

    def __init__(
        self, spans: Sequence[tuple[int, int]], *, async_scheduling: bool, stats: CloneStats
    ) -> None:
        super().__init__(async_scheduling=async_scheduling, stats=stats)
        self._spans = tuple(spans)
        self._sums: list[torch.Tensor | None] = [None] * len(self._spans)  # [hidden] f64, owned
        self._seen = 0  # prompt tokens in earlier chunks

    def add_chunk(
        self, hidden: torch.Tensor, token_ids: Sequence[int], is_last: bool
    ) -> torch.Tensor | None:
        """Add each span's rows of this chunk to its sum; the span means on the last chunk."""
        start, self._seen = self._seen, self._seen + hidden.shape[0]
        rows = hidden.double()  # [n, hidden]
        # row slices are views: no index tensor is copied to the device (no wait on it)
        for index, (first, stop) in enumerate(self._spans):
            low, high = max(first, start), min(stop, self._seen)
            if low < high:
                part = rows[low - start : high - start].sum(dim=0)  # [hidden], a fresh reduction
                kept = self._sums[index]
                self._sums[index] = part if kept is None else kept + part
        if not is_last:
            return None
        sums = [kept for kept in self._sums if kept is not None]
        if len(sums) != len(self._spans) or self._seen < max(stop for _, stop in self._spans):
            raise PoolingStateError(f"a span ends past the prompt's {self._seen} tokens")
        means = [s / (stop - first) for s, (first, stop) in zip(sums, self._spans, strict=True)]
        self.close()
        return torch.stack(means).float()  # [num_spans, hidden]

    def close(self) -> None:
        """Drop the running sums."""
        self._sums = [None] * len(self._spans)
        self._seen = 0


class _ChunkList:
    """Parts kept across chunks and concatenated on the last one (ALL and untagged STEP)."""

    def __init__(self, finish_view: Callable[[torch.Tensor], torch.Tensor], stats: CloneStats):
        self._finish_view = finish_view
        self._stats = stats
        self.parts: list[torch.Tensor] = []

    def add(self, part: torch.Tensor, is_view: bool, is_last: bool) -> torch.Tensor | None:
        """Keep `part` (owned) or, on the last chunk, return all parts as one owned tensor."""
        if not is_last:
            self.parts.append(_own(part, self._stats) if is_view else part)
            return None
        if not self.parts:
            return self._finish_view(part) if is_view else part
        result = torch.cat([*self.parts, part])  # [num_rows, hidden], owns its storage
        self.parts.clear()
        return result


class AllPool(PoolingMethod):
    """Every token's hidden state, `[num_tokens, hidden]`."""

    pooling_type = PoolingType.ALL

    def __init__(self, *, async_scheduling: bool, stats: CloneStats) -> None:
        super().__init__(async_scheduling=async_scheduling, stats=stats)
        self._chunks = _ChunkList(self._finish_view, stats)

    @property
    def cached_chunks(self) -> tuple[torch.Tensor, ...]:
        """The chunks kept from earlier steps (owned copies)."""
        return tuple(self._chunks.parts)

    def add_chunk(
        self, hidden: torch.Tensor, token_ids: Sequence[int], is_last: bool
    ) -> torch.Tensor | None:
        """Keep an owned copy of each earlier chunk; concatenate on the last chunk."""
        return self._chunks.add(hidden, is_view=True, is_last=is_last)

    def close(self) -> None:
        """Drop the kept chunks."""
        self._chunks.parts.clear()


class StepPool(PoolingMethod):
    """Hidden states at step-tag positions, `[num_steps, hidden]`; every position when untagged."""

    pooling_type = PoolingType.STEP

    def __init__(
        self, step_tag_id: int | None, *, async_scheduling: bool, stats: CloneStats
    ) -> None:
        super().__init__(async_scheduling=async_scheduling, stats=stats)
        self.step_tag_id = step_tag_id
        self._steps = _ChunkList(self._finish_view, stats)

    @property
    def cached_chunks(self) -> tuple[torch.Tensor, ...]:
        """The step rows kept from earlier steps (owned)."""
        return tuple(self._steps.parts)

    def add_chunk(
        self, hidden: torch.Tensor, token_ids: Sequence[int], is_last: bool
    ) -> torch.Tensor | None:
        """Select this chunk's step rows; concatenate them on the last chunk."""
        if self.step_tag_id is None:
            return self._steps.add(hidden, is_view=True, is_last=is_last)
        # Positions come from host token ids and rows are gathered by views: no index tensor is
        # copied to the device, so finding the tags never waits on the device.
        positions = [i for i, token in enumerate(token_ids) if token == self.step_tag_id]
        if positions:
            steps = torch.stack([hidden[i] for i in positions])  # [num_tags, hidden], new storage
        else:
            steps = hidden.new_empty((0, hidden.shape[1]))  # [0, hidden]
        return self._steps.add(steps, is_view=False, is_last=is_last)

    def close(self) -> None:
        """Drop the kept step rows."""
        self._steps.parts.clear()


_SIMPLE_METHODS: dict[PoolingType, type[PoolingMethod]] = {
    PoolingType.CLS: CLSPool,
    PoolingType.LAST: LastPool,
    PoolingType.MEAN: MeanPool,
    PoolingType.ALL: AllPool,
}


# methods that can pass over a prompt's leading tokens
_SKIPPING_METHODS: dict[PoolingType, Callable[..., PoolingMethod]] = {
    PoolingType.MEAN: SkipMeanPool,
    PoolingType.CLS: SkipCLSPool,
}


def build_method(
    pooling_type: PoolingType,
    *,
    async_scheduling: bool,
    stats: CloneStats,
    step_tag_id: int | None = None,
    skip_tokens: int = 0,
    token_spans: Sequence[tuple[int, int]] | None = None,
) -> PoolingMethod:
    """A fresh per-request method of the given type (CLS and MEAN may pass over leading tokens).

    With `token_spans` (late chunking) the request pools one mean per span, whatever the type.
    """
    if token_spans is not None:
        return SpanMeanPool(token_spans, async_scheduling=async_scheduling, stats=stats)
    if pooling_type is PoolingType.STEP:
        return StepPool(step_tag_id, async_scheduling=async_scheduling, stats=stats)
    if skip_tokens and pooling_type in _SKIPPING_METHODS:
        return _SKIPPING_METHODS[pooling_type](
            skip_tokens, async_scheduling=async_scheduling, stats=stats
        )
    return _SIMPLE_METHODS[pooling_type](async_scheduling=async_scheduling, stats=stats)
