"""Late chunking's answer: one item per span, in input then span order, saying where it is from.

Each input's output is `[num_spans, dim]`; its rows become items numbered by a running `index`,
each with the `input_index` it came from and its `span` of characters `[start, end]`.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Protocol

import numpy as np

from poolserve.frontend.encoding import encode_item
from poolserve.frontend.spans import CharSpans
from poolserve.types.errors import StepFailedError
from poolserve.types.outputs import PoolingOutput


class Encoding(Protocol):
    """How the rows travel: a request body's fields, or the form /v1/embeddings resolved."""

    @property
    def encoding_format(self) -> str: ...

    @property
    def embed_dtype(self) -> str: ...


@dataclass(frozen=True)
class SpanRows:
    """Every span's row of output and where it comes from, in answer order."""

    arrays: list[np.ndarray]  # each [dim], a view of its input's output
    where: list[dict[str, object]]  # {"input_index": i, "span": [start, end]}

    def without_origin(self) -> SpanRows:
        """The rows as plain items: Jina's `late_chunking: true` answers one per input, its spans
        being the inputs themselves (frontend/joined.py)."""
        return SpanRows(self.arrays, [{} for _ in self.arrays])

    def items(
        self,
        head: Callable[[int], dict[str, object]],
        key: str,
        encoding: Encoding,
        endianness: str,
        *,
        shape: bool = False,
    ) -> Iterator[bytes]:
        """Each row as its encoded item: `head(index)`, where it is from, then `key`'s data."""
        for index, (data, where) in enumerate(zip(self.arrays, self.where, strict=True)):
            fields = {**head(index), **where}
            if shape:
                fields["shape"] = list(data.shape)
            fmt, dtype = encoding.encoding_format, encoding.embed_dtype
            yield encode_item(fields, key, data, fmt, dtype, endianness)


def span_rows(spans: CharSpans | None, outputs: Sequence[PoolingOutput]) -> SpanRows | None:
    """The rows of a late-chunking job, given each input's spans (None: any other job)."""
    if spans is None:
        return None
    arrays: list[np.ndarray] = []
    where: list[dict[str, object]] = []
    for index, (output, ranges) in enumerate(zip(outputs, spans, strict=True)):
        if output.data.shape[0] != len(ranges):  # the engine pooled other spans: never expected
            raise StepFailedError(f"{output.data.shape[0]} rows for {len(ranges)} spans")
        arrays.extend(output.data)
        where.extend({"input_index": index, "span": [start, end]} for start, end in ranges)
    return SpanRows(arrays, where)
